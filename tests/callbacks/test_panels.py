"""Tests for keras_keepgrad.callbacks.panels: tags and the scalar writer."""

import numpy as np
import tensorflow as tf
from callback_helpers import read_run
from callback_helpers import scalars

from keras_keepgrad.callbacks import panels


def test_layer_tags_are_the_layer_paths():
    # No position in the tag: the same layer has the same tag in any model.
    assert panels.layer_norm_tag("dense_1") == "gradients/log10_norm/dense_1"
    assert panels.layer_norm_tag("encoder/dense") == "gradients/log10_norm/encoder/dense"


def test_layer_blocks_split_evenly_past_the_block_size():
    assert panels.layer_blocks(16) == []  # the overview chart shows them all
    assert panels.layer_blocks(17) == [(0, 8), (8, 17)]
    assert panels.layer_blocks(33, size=16) == [(0, 11), (11, 22), (22, 33)]
    # MobileNetV2's 105 layers with weights: 7 blocks of 15.
    blocks = panels.layer_blocks(105)
    assert [stop - start for start, stop in blocks] == [15] * 7
    assert blocks[0][0] == 0 and blocks[-1][1] == 105


def test_nonfinite_histogram_kinds():
    # -1 for -inf, 0 for NaN, +1 for +inf; finite entries are not counted.
    assert panels.nonfinite_kinds(
        tf.constant([1.0, -np.inf, np.nan, np.inf, np.nan])
    ).numpy().tolist() == [-1.0, 0.0, 1.0, 0.0]


def test_scalar_writer_buffers_rows_until_full_or_flushed(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    scalar_writer = panels.ScalarWriter(
        writer, ["a", "b"], traced=True, max_rows=3, max_seconds=3600.0
    )
    scalar_writer.write(1, [1.0, 2.0])
    scalar_writer.write(2, [3.0, np.nan])
    writer.flush()
    assert read_run(str(tmp_path)).Tags()["tensors"] == []  # still buffered
    scalar_writer.write(3, [5.0, 6.0])  # the third row fills the buffer
    scalar_writer.write(4, [7.0, 8.0])
    scalar_writer.flush()
    writer.flush()
    acc = read_run(str(tmp_path))
    assert scalars(acc, "a") == [(1, 1.0), (2, 3.0), (3, 5.0), (4, 7.0)]
    b = scalars(acc, "b")
    assert [s for s, _ in b] == [1, 2, 3, 4] and np.isnan(b[1][1])
    assert [v for _, v in b if np.isfinite(v)] == [2.0, 6.0, 8.0]


def test_scalar_writer_writes_one_event_per_step_and_metadata_once(tmp_path):
    # TensorBoard keeps a tag's first metadata: later values carry none.
    from tensorboard.compat.proto import event_pb2

    writer = tf.summary.create_file_writer(str(tmp_path))
    traced = panels.ScalarWriter(
        writer, ["a", "c"], traced=True, descriptions=["what a is", "what c is"]
    )
    eager = panels.ScalarWriter(writer, ["b"], traced=False, descriptions=["what b is"])
    for step in (1, 2, 3):
        traced.write(step, [float(step), 10.0 * step])
        eager.write(step, [-float(step)])
    traced.flush()
    writer.flush()
    (path,) = [p for p in tmp_path.iterdir()]
    events = [
        event_pb2.Event.FromString(record.numpy()) for record in tf.data.TFRecordDataset(str(path))
    ]
    # One event per written row, holding its values in the tags' order.
    rows = [
        (e.step, [(v.tag, v.metadata.plugin_data.plugin_name) for v in e.summary.value])
        for e in events
        if e.HasField("summary")
    ]
    eager_rows = [(s, [("b", "scalars" if s == 1 else "")]) for s in (1, 2, 3)]
    traced_rows = [
        (s, [("a", "scalars" if s == 1 else ""), ("c", "scalars" if s == 1 else "")])
        for s in (1, 2, 3)
    ]
    assert rows == eager_rows + traced_rows  # the traced rows wait for `flush`
    acc = read_run(str(tmp_path))
    assert scalars(acc, "a") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert scalars(acc, "c") == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert scalars(acc, "b") == [(1, -1.0), (2, -2.0), (3, -3.0)]
    assert acc.SummaryMetadata("a").summary_description == "what a is"
    assert acc.SummaryMetadata("c").summary_description == "what c is"
    assert acc.SummaryMetadata("b").plugin_data.plugin_name == "scalars"
    # Each value is a float32 scalar, as `tf.summary.scalar` writes it.
    (event,) = acc.Tensors("c")[:1]
    assert event.tensor_proto.dtype == tf.float32.as_datatype_enum
    assert event.tensor_proto.tensor_shape.dim == []


def test_step_function_writer_writes_changes_and_holds_the_line(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    counts = panels.StepFunctionWriter(writer, "n", traced=True)
    # 0 up to step 4, 1 from step 5, 2 from step 6, then 2 up to step 9.
    for step, value in [(1, 0), (2, 0), (4, 0), (5, 1), (6, 2), (8, 2), (9, 2)]:
        counts.add(step, value)
    counts.flush()  # an epoch end: the last step added
    counts.flush()  # twice: nothing new
    writer.flush()
    acc = read_run(str(tmp_path))
    # The first step, the step before each change, each change, the last.
    assert scalars(acc, "n") == [(1, 0.0), (4, 0.0), (5, 1.0), (6, 2.0), (9, 2.0)]
