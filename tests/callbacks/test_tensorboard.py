"""Tests for keras_keepgrad.callbacks.tensorboard: GradientTensorBoard.

Every test reads the event files back.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf
from callback_helpers import hand_data
from callback_helpers import hand_model
from callback_helpers import layer_norms
from callback_helpers import read_run
from callback_helpers import scalars
from callback_helpers import tape_gradients
from callback_helpers import two_layer_model
from conftest import Recorder
from conftest import free_ports
from conftest import keras_histogram_tag

import keras_keepgrad as kg
from keras_keepgrad import callbacks


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    """One `fit` of the hand model: 3 batches, every batch recorded."""
    log_dir = str(tmp_path_factory.mktemp("hand") / "logs")
    model = hand_model()
    recorder = Recorder()
    x, y = hand_data(3)
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            callbacks.GradientTensorBoard(log_dir, update_freq="batch", histogram_freq=1),
            recorder,
        ],
    )
    return log_dir, recorder


def log10(*norms):
    """log10 as the scalars hold it: float32."""
    return [float(np.float32(np.log10(v))) for v in norms]


def test_tensorboard_norms_are_the_kept_gradients_norms(hand_run):
    log_dir, recorder = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    kept = [float(g["dense_0/kernel"][0, 0]) for g in recorder.grads]
    assert kept == [15.0, 7.5, 3.75]
    # log10 of the norms 15, 7.5, 3.75, each written once.
    expected = list(zip([1, 2, 3], log10(15.0, 7.5, 3.75)))
    assert scalars(acc, "gradients/log10_norm/dense_0") == expected
    assert scalars(acc, "gradients/log10_global_norm") == expected
    # No non-finite step: 0 at the first step and at the epoch's last.
    assert scalars(acc, "gradients/nonfinite_steps") == [(1, 0.0), (3, 0.0)]
    # Each number once: these, the heatmap and Keras's batch metrics (at
    # the same steps), nothing else.
    assert sorted(t for t in acc.Tags()["tensors"] if t.startswith("gradients/")) == [
        "gradients/heatmap",
        "gradients/log10_global_norm",
        "gradients/log10_norm/dense_0",
        "gradients/nonfinite_steps",
    ]
    assert [e.step for e in acc.Tensors("batch_loss")] == [1, 2, 3]
    # The descriptions TensorBoard shows beside the charts.
    description = acc.SummaryMetadata("gradients/log10_norm/dense_0").summary_description
    assert description.startswith("log10 of the L2 norm of this layer's gradients")


def test_tensorboard_per_layer_tags_do_not_depend_on_the_model(tmp_path):
    # The same layer name, first or second in forward order: the same tag.
    first, second = two_layer_model(), two_layer_model(names=("dense_a", "dense_0"))
    x, y = np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32)
    for name, model in [("first", first), ("second", second)]:
        model.fit(
            x,
            y,
            batch_size=2,
            verbose=0,
            callbacks=[callbacks.GradientTensorBoard(tmp_path / name, update_freq=1)],
        )
    tags = {
        name: [
            t
            for t in read_run(str(tmp_path / name / "train")).Tags()["tensors"]
            if t.startswith("gradients/log10_norm/")
        ]
        for name in ("first", "second")
    }
    assert tags == {
        "first": ["gradients/log10_norm/dense_0", "gradients/log10_norm/dense_1"],
        "second": ["gradients/log10_norm/dense_a", "gradients/log10_norm/dense_0"],
    }


def test_tensorboard_histograms_sit_beside_the_weights(hand_run):
    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    tags = acc.Tags()["tensors"]
    assert keras_histogram_tag("dense_0/kernel") in tags  # Keras's weights
    (event,) = acc.Tensors("dense_0/kernel/gradient")
    assert event.step == 0  # the epoch, as Keras's weight histograms
    buckets = tf.make_ndarray(event.tensor_proto)  # [left, right, count]
    assert buckets[:, 2].sum() == 1.0
    assert buckets[:, 0].min() == 3.75 and buckets[:, 1].max() == 3.75
    # By magnitude, in decades: log10(3.75) = 0.574.
    (event,) = acc.Tensors("dense_0/kernel/gradient_log10_abs")
    buckets = tf.make_ndarray(event.tensor_proto)
    assert buckets[:, 2].sum() == 1.0
    assert buckets[:, 0].min() == buckets[:, 1].max()
    assert buckets[:, 0].min() == pytest.approx(np.log10(3.75), rel=1e-12)
    # All finite: no non-finite companion.
    assert "dense_0/kernel/gradient_nonfinite" not in tags
    assert not [t for t in tags if t.startswith("gradients/histogram/")]


def test_tensorboard_gradient_histograms_every_n_batches(tmp_path):
    log_dir = str(tmp_path / "logs")
    x, y = hand_data(3)
    hand_model().fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            callbacks.GradientTensorBoard(log_dir, histogram_freq=1, gradient_histogram_freq=2)
        ],
    )
    acc = read_run(os.path.join(log_dir, "train"))
    # Every 2 batches, at the training-batch step: step 2 holds 7.5. The
    # epoch histogram of the gradients is not written then (the weights' is).
    events = acc.Tensors("dense_0/kernel/gradient")
    assert [e.step for e in events] == [2]
    buckets = tf.make_ndarray(events[0].tensor_proto)
    assert buckets[:, 0].min() == 7.5 and buckets[:, 2].sum() == 1.0
    assert [e.step for e in acc.Tensors(keras_histogram_tag("dense_0/kernel"))] == [0]


def nan_model_and_data():
    """The two-layer model; batch 2 (of 3) holds a NaN and an inf input."""
    model = two_layer_model()
    x = np.ones((6, 2), np.float32)
    x[2, 0] = np.nan
    x[3, 1] = np.inf
    return model, x, np.zeros((6, 1), np.float32)


def test_tensorboard_marks_nonfinite_steps_and_histogram_slices(tmp_path):
    log_dir = str(tmp_path / "logs")
    model, x, y = nan_model_and_data()
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            callbacks.GradientTensorBoard(log_dir, update_freq=1, gradient_histogram_freq=1)
        ],
    )
    acc = read_run(os.path.join(log_dir, "train"))
    # Steps 2 and 3 are non-finite: the count goes 0, 1, 2.
    assert scalars(acc, "gradients/nonfinite_steps") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    for tag in ("gradients/log10_norm/dense_1", "gradients/log10_global_norm"):
        written = scalars(acc, tag)
        assert [s for s, _ in written] == [1, 2, 3]
        assert np.isfinite(written[0][1]) and np.isnan(written[1][1]) and np.isnan(written[2][1])
    # dense_0's kernel gradient at step 2: 2x3 entries, every one NaN or
    # inf (an inf input times a finite error is inf, NaN where they meet).
    # Its histogram slice holds no value; the companion counts all 6.
    tags = acc.Tags()["tensors"]
    (event,) = [e for e in acc.Tensors("dense_0/kernel/gradient") if e.step == 2]
    assert tf.make_ndarray(event.tensor_proto)[:, 2].sum() == 0.0
    bad = {
        e.step: tf.make_ndarray(e.tensor_proto)
        for e in acc.Tensors("dense_0/kernel/gradient_nonfinite")
    }
    assert sorted(bad) == [2, 3] and bad[2][:, 2].sum() == 6.0
    # Step 1 was finite: no companion slice there, a full gradient slice.
    (first,) = [e for e in acc.Tensors("dense_0/kernel/gradient") if e.step == 1]
    assert tf.make_ndarray(first.tensor_proto)[:, 2].sum() == 6.0
    assert "dense_1/bias/gradient_nonfinite" in tags
    # The heatmap names the first non-finite step: the red NaN color is in it.
    _, _, png = tf.make_ndarray(acc.Tensors("gradients/heatmap")[0].tensor_proto)
    image = tf.io.decode_png(png).numpy()
    assert (image == [255, 0, 0]).all(axis=-1).sum() > 5000


def test_tensorboard_layout_groups_the_gradient_panels(hand_run):
    from tensorboard.plugins.custom_scalar import layout_pb2

    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    # No loss-scale category without a LossScaleOptimizer, no blocks for
    # one layer. The overview picks the layers by prefix: the same chart
    # in every run.
    (category,) = layout.category
    assert category.title == "Gradient panels"
    charts = [(c.title, list(c.multiline.tag)) for c in category.chart]
    assert charts == [
        (
            "Gradient norm, log10: global, then each layer in forward order",
            ["^gradients/log10_global_norm$", "^gradients/log10_norm/"],
        ),
        ("Non-finite steps so far", ["^gradients/nonfinite_steps$"]),
    ]


def test_tensorboard_layout_blocks_of_many_layers(tmp_path):
    # 20 one-unit Dense layers, d00 to d19: blocks of 10 after the overview.
    inputs = keras.Input((1,))
    h = inputs
    for i in range(20):
        h = keras.layers.Dense(1, name=f"d{i:02d}")(h)
    model = kg.KeepGradModel(inputs, h)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(
        np.ones((2, 1)),
        np.zeros((2, 1)),
        verbose=0,
        callbacks=[callbacks.GradientTensorBoard(tmp_path, write_heatmap=False)],
    )
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = read_run(str(tmp_path / "train"))
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    assert [c.title for c in layout.category] == [
        "Gradient panels",
        "Gradient panels: layers in forward order",
    ]
    blocks = [(c.title, list(c.multiline.tag)) for c in layout.category[1].chart]
    assert [title for title, _ in blocks] == [
        "Layers 1-10 of 20: d00 to d09, log10 norm",
        "Layers 11-20 of 20: d10 to d19, log10 norm",
    ]
    # Each block: the global norm for reference, then its layers in order.
    assert blocks[1][1] == ["^gradients/log10_global_norm$"] + [
        f"^gradients/log10_norm/d{i}$" for i in range(10, 20)
    ]
    # The run's first write puts the overview's lines in forward order.
    assert [t for t in acc.Tags()["tensors"] if "log10" in t] == ["gradients/log10_global_norm"] + [
        f"gradients/log10_norm/d{i:02d}" for i in range(20)
    ]


def test_tensorboard_heatmap_is_a_labelled_figure(hand_run):
    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    (event,) = acc.Tensors("gradients/heatmap")
    width, height, png = tf.make_ndarray(event.tensor_proto)
    image = tf.io.decode_png(png).numpy()
    # 1200 x (66 + 270 + 110) pixels, whatever the number of layers.
    assert (int(width), int(height)) == (1200, 446) and image.shape == (446, 1200, 3)
    # Finite norms only: the NaN red is only in the legend's small patch
    # (a NaN cell would be a sixth of the plot, as in the test above).
    assert (image == [255, 0, 0]).all(axis=-1).sum() < 500
    # The fixed scale 1e-8 .. 1e4: the three cells, steps 1 to 3 left to
    # right, are viridis at (log10(norm) + 8) / 12 = 0.7647, 0.7396 and
    # 0.7145 (matplotlib's `colormaps["viridis"]`, times 255, rounded).
    colors = {15.0: [101, 203, 94], 7.5: [88, 199, 101], 3.75: [74, 193, 109]}
    # The plot ends left of x = 900, where the color bar (which holds the
    # same colors) begins.
    plot = image[:, :900]
    where = {v: np.nonzero((plot == c).all(axis=-1)) for v, c in colors.items()}
    assert all(len(rows) > 10_000 for rows, _ in where.values())
    (left_rows, left), (_, right) = where[15.0], where[3.75]
    row, middle = int(np.median(left_rows)), int((left.mean() + right.mean()) / 2)
    assert left.max() < middle < right.min()
    assert image[row, middle].tolist() == colors[7.5]


@pytest.mark.backends(
    "tensorflow",
    reason="a TensorBoard server subprocess: a slow check kept out of the per-backend runs",
)
@pytest.mark.slow
def test_tensorboard_server_serves_the_gradient_panels(hand_run, tmp_path):
    log_dir, _ = hand_run
    (port,) = free_ports(1)
    log_file = open(tmp_path / "tensorboard.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            log_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    # Never through a proxy: only this machine's server.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(route):
        with opener.open(f"http://127.0.0.1:{port}{route}", timeout=5) as response:
            return json.load(response)

    try:
        deadline = time.monotonic() + 60
        scalar_tags = {}
        while "gradients/log10_global_norm" not in scalar_tags.get("train", {}):
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()
            assert time.monotonic() < deadline, "TensorBoard did not serve the logs"
            time.sleep(0.5)
            try:
                scalar_tags = get("/data/plugin/scalars/tags")
            except OSError:
                pass
        assert {
            "gradients/log10_norm/dense_0",
            "gradients/log10_global_norm",
            "gradients/nonfinite_steps",
        } <= set(scalar_tags["train"])
        histogram_tags = get("/data/plugin/histograms/tags")
        assert {"dense_0/kernel/gradient", keras_histogram_tag("dense_0/kernel")} <= set(
            histogram_tags["train"]
        )
        layout = get("/data/plugin/custom_scalars/layout")
        (category,) = layout["category"]
        assert category["title"] == "Gradient panels"
        # The overview chart's patterns, joined as TensorBoard's page joins
        # them: the global norm, then the layers, in the order written.
        patterns = category["chart"][0]["multiline"]["tag"]
        joined = "|".join(f"({p})" for p in patterns)
        matched = get(
            "/data/plugin/custom_scalars/scalars?run=train&tag=" + urllib.request.quote(joined)
        )
        assert list(matched["tag_to_events"]) == [
            "gradients/log10_global_norm",
            "gradients/log10_norm/dense_0",
        ]
        values = [e[2] for e in matched["tag_to_events"]["gradients/log10_norm/dense_0"]]
        assert values == log10(15.0, 7.5, 3.75)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log_file.close()


@pytest.mark.backends(
    "tensorflow", "jax", reason="Keras's PyTorch trainer refuses steps_per_execution > 1"
)
def test_tensorboard_steps_per_execution_validation_and_epoch_freq(tmp_path):
    # 10 samples, batch 2: 5 batches per epoch; 2 per execution, so Keras
    # calls back after batches 2, 4, 5 (partial execution), 7, 9, 10.
    model = two_layer_model(steps_per_execution=2)
    x = np.arange(20, dtype="float32").reshape(10, 2) / 10.0
    y = np.ones((10, 1), "float32")
    recorder = Recorder()
    every_2 = callbacks.GradientTensorBoard(tmp_path / "every_2", update_freq=2)
    per_epoch = callbacks.GradientTensorBoard(tmp_path / "per_epoch")
    model.fit(
        x,
        y,
        batch_size=2,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x[:4], y[:4]),
        callbacks=[every_2, per_epoch, recorder],
    )
    assert len(recorder.grads) == 6
    # The steps Keras calls back after, 1-based, as a tape computes them.
    tape = tape_gradients(two_layer_model(cls=keras.Model), x, y, batch_size=2, epochs=2)
    reference = {s: layer_norms(tape[s - 1]) for s in [2, 4, 5, 7, 9, 10]}
    globals_ = {
        s: float(np.sqrt(sum(n**2 for n in norms.values()))) for s, norms in reference.items()
    }
    for name, steps in [("every_2", [2, 4, 7, 9, 10]), ("per_epoch", [5, 10])]:
        acc = read_run(str(tmp_path / name / "train"))
        for layer in ("dense_0", "dense_1"):
            written = scalars(acc, f"gradients/log10_norm/{layer}")
            assert [s for s, _ in written] == steps
            np.testing.assert_allclose(
                [v for _, v in written], np.log10([reference[s][layer] for s in steps]), rtol=1e-6
            )
        written = scalars(acc, "gradients/log10_global_norm")
        assert [s for s, _ in written] == steps
        np.testing.assert_allclose(
            [v for _, v in written], np.log10([globals_[s] for s in steps]), rtol=1e-6
        )
        # Finite throughout: 0 at the first recorded step and at each
        # epoch's last recorded one (every_2: 4 and 10).
        held = {"every_2": [2, 4, 10], "per_epoch": [5, 10]}[name]
        assert scalars(acc, "gradients/nonfinite_steps") == [(s, 0.0) for s in held]
        # Keras's validation run is still there.
        val = read_run(str(tmp_path / name / "validation"))
        assert [e.step for e in val.Tensors("epoch_loss")] == [0, 1]


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_precision_skipped_step_panels_and_snapshot(tmp_path, mixed_float16):
    # Batch 2 holds a NaN: the LossScaleOptimizer skips it and halves its
    # scale (8 -> 4); batch 3 sees w = 1.5 still, so 7.5.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    model = hand_model(optimizer=optimizer)
    x, y = hand_data(3)
    x[3, 0] = np.nan
    snapshot = callbacks.GradientSnapshot(tmp_path / "snap" / "{step}.npz", every=1)
    model.fit(
        x,
        y,
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=1),
            snapshot,
        ],
    )
    acc = read_run(str(tmp_path / "logs" / "train"))
    # The NaN step's log10 norms are NaN (TensorBoard marks them).
    for tag in ("gradients/log10_global_norm", "gradients/log10_norm/dense_0"):
        norms = scalars(acc, tag)
        assert [norms[0], norms[2]] == list(zip([1, 3], log10(15.0, 7.5)))
        assert norms[1][0] == 2 and np.isnan(norms[1][1])
    assert scalars(acc, "gradients/nonfinite_steps") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert scalars(acc, "gradients/skipped_steps") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert scalars(acc, "gradients/loss_scale") == [(1, 8.0), (2, 4.0), (3, 4.0)]
    # The loss scale has its own category, only in this run's layout.
    from tensorboard.plugins.custom_scalar import layout_pb2

    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    assert [c.title for c in layout.category] == ["Gradient panels", "Gradient panels: loss scale"]
    (chart,) = layout.category[1].chart
    assert list(chart.multiline.tag) == ["^gradients/loss_scale$"]
    skipped = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert skipped["Non-finite steps so far, and steps skipped by the loss scale"] == [
        "^gradients/nonfinite_steps$",
        "^gradients/skipped_steps$",
    ]
    loaded = [np.load(f) for f in snapshot.files]
    assert [float(d["loss_scale"]) for d in loaded] == [8.0, 4.0, 4.0]
    assert loaded[0]["dense_0/kernel"].dtype == np.float32  # as the optimizer gets it
    assert float(loaded[2]["dense_0/kernel"][0, 0]) == 7.5


def test_keep_every_optimizer_scalars_sit_at_the_current_step(tmp_path):
    # keep_every=3 writes the slots on steps 1, 4, 7, 10; update_freq=5
    # records after steps 5 and 10, reading steps 4 and 10 (lr 0: 5w = 15).
    # Batch 2 holds a NaN: the LossScaleOptimizer skips step 2 (scale 8 ->
    # 4). After step 5 it applied 4 steps: 1 skipped; written at step 5,
    # not at the kept step 4 (where 4 - 4 applied would say 0, and step 4's
    # labels once read -1 without a skipped step).
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=8.0)
    model = hand_model(optimizer=optimizer, keep_every=3)
    x, y = hand_data(10)
    x[3, 0] = np.nan
    board = callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=5)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[board])
    acc = read_run(str(tmp_path / "logs" / "train"))
    assert scalars(acc, "gradients/log10_global_norm") == list(zip([4, 10], log10(15.0, 15.0)))
    assert scalars(acc, "gradients/nonfinite_steps") == [(4, 0.0), (10, 0.0)]
    assert scalars(acc, "gradients/skipped_steps") == [(5, 1.0), (10, 1.0)]
    assert scalars(acc, "gradients/loss_scale") == [(5, 4.0), (10, 4.0)]


@pytest.mark.parametrize("board_first", [True, False])
def test_buffered_scalars_are_written_before_the_monitor_raises(tmp_path, board_first):
    # The NaN batch (step 2) makes GradientMonitor raise: fit ends without
    # `on_train_end`. The board writes a non-finite step at once; called
    # after the monitor it never sees step 2, and the monitor writes the
    # buffered step 1 before it raises.
    log_dir = str(tmp_path / "logs")
    model, x, y = nan_model_and_data()
    board = callbacks.GradientTensorBoard(log_dir, update_freq=1)
    monitor = callbacks.GradientMonitor(action="raise")
    with pytest.raises(RuntimeError, match="Step 2: non-finite"):
        model.fit(
            x,
            y,
            batch_size=2,
            shuffle=False,
            verbose=0,
            callbacks=[board, monitor] if board_first else [monitor, board],
        )
    board._train_writer.flush()
    acc = read_run(os.path.join(log_dir, "train"))
    steps = [1, 2] if board_first else [1]
    assert scalars(acc, "gradients/nonfinite_steps") == [(1, 0.0), (2, 1.0)][: len(steps)]
    assert [e.step for e in acc.Tensors("batch_loss")] == steps
