"""Tests for keras_keepgrad.callbacks.panels: tags and the scalar writer."""

import numpy as np
import tensorflow as tf
from callback_helpers import read_run
from callback_helpers import scalars

from keras_keepgrad.callbacks import panels


def test_log10_tags_number_layers_in_forward_order():
    layers = [f"layer_{i}" for i in range(12)]
    tags = panels.log10_norm_tags(["dense_b", "bn_a", "out"])
    assert tags == [
        "log10_grad_norm/00_dense_b",
        "log10_grad_norm/01_bn_a",
        "log10_grad_norm/02_out",
    ]
    # Sorting the tags as text (as TensorBoard does) keeps forward order.
    assert sorted(panels.log10_norm_tags(layers)) == panels.log10_norm_tags(layers)
    assert panels.log10_norm_tags([f"l{i}" for i in range(101)])[7] == ("log10_grad_norm/007_l7")


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
