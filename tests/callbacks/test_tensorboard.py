"""Tests for keras_keepgrad.callbacks.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import glob
import json
import os
import subprocess
import sys
import time
import urllib.request
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import MODES
from conftest import LateBuilt
from conftest import Recorder
from conftest import free_ports
from tensorboard.backend.event_processing import event_accumulator

import keras_keepgrad as kg
from keras_keepgrad import callbacks
from keras_keepgrad.callbacks import heatmap as heatmaps
from keras_keepgrad.callbacks import panels


def hand_model(lr=0.1, optimizer=None, keep_every=1, **compile_kwargs):
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(3.0),
        name="dense_0",
    )(inputs)
    model = kg.KeepGradModel(inputs, outputs, keep_every=keep_every)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(lr), loss="mse", **compile_kwargs)
    return model


def hand_data(batches):
    x = np.tile(np.array([[1.0], [2.0]]), (batches, 1))
    return x, np.zeros_like(x)


def two_layer_model(names=("dense_0", "dense_1"), cls=kg.KeepGradModel, **kwargs):
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(
        3, kernel_initializer="ones", bias_initializer="ones", name=names[0]
    )(inputs)
    outputs = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.Constant(0.5),
        name=names[1],
    )(hidden)
    model = cls(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", **kwargs)
    return model


def tape_gradients(model, x, y, batch_size, epochs):
    """Each step's `{path: gradient}` of a plain model trained batch by batch
    in order with a `tf.GradientTape` and its optimizer: the reference."""
    found = []
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            model.optimizer.apply(grads, variables)
            found.append({v.path: g.numpy() for v, g in zip(variables, grads)})
    return found


def layer_norms(grads):
    """Reference per-layer norms: path minus last component, in order."""
    sums = {}
    for path, grad in grads.items():
        layer = path.rpartition("/")[0]
        sums[layer] = sums.get(layer, 0.0) + float(np.sum(np.square(grad.astype(np.float64))))
    return {layer: np.sqrt(total) for layer, total in sums.items()}


def read_run(directory):
    acc = event_accumulator.EventAccumulator(
        directory, size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


# GradientTensorBoard -------------------------------------------------------


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


def test_tensorboard_norms_are_the_kept_gradients_norms(hand_run):
    log_dir, recorder = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    kept = [float(g["dense_0/kernel"][0, 0]) for g in recorder.grads]
    assert kept == [15.0, 7.5, 3.75]
    expected = [(1, 15.0), (2, 7.5), (3, 3.75)]
    assert scalars(acc, "gradients/layer_norm/dense_0") == expected
    assert scalars(acc, "gradients/global_norm") == expected
    assert scalars(acc, "gradients/nonfinite") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    # Keras's own batch metrics are still written, at the same steps.
    assert [e.step for e in acc.Tensors("batch_loss")] == [1, 2, 3]
    # No loss-scale panels without a LossScaleOptimizer.
    assert "gradients/loss_scale" not in acc.Tags()["tensors"]


def test_tensorboard_log10_norms_in_forward_order(hand_run):
    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    # log10 of the norms 15, 7.5, 3.75, as float32 like every scalar.
    expected = [
        (step, float(np.float32(np.log10(v)))) for step, v in [(1, 15.0), (2, 7.5), (3, 3.75)]
    ]
    assert scalars(acc, "log10_grad_norm/00_dense_0") == expected
    assert scalars(acc, "log10_grad_norm/global") == expected


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


def test_tensorboard_histograms_sit_beside_the_weights(hand_run):
    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    tags = acc.Tags()["tensors"]
    assert "dense_0/kernel/histogram" in tags  # Keras's weights
    (event,) = acc.Tensors("dense_0/kernel/gradient")
    assert event.step == 0  # the epoch, as Keras's weight histograms
    buckets = tf.make_ndarray(event.tensor_proto)  # [left, right, count]
    assert buckets[:, 2].sum() == 1.0
    assert buckets[:, 0].min() == 3.75 and buckets[:, 1].max() == 3.75
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
    assert [e.step for e in acc.Tensors("dense_0/kernel/histogram")] == [0]


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
    assert scalars(acc, "gradients/nonfinite") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    log10 = scalars(acc, "log10_grad_norm/01_dense_1")
    assert np.isfinite(log10[0][1]) and np.isnan(log10[1][1]) and np.isnan(log10[2][1])
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


def test_nonfinite_histogram_kinds():
    # -1 for -inf, 0 for NaN, +1 for +inf; finite entries are not counted.
    assert panels.nonfinite_kinds(
        tf.constant([1.0, -np.inf, np.nan, np.inf, np.nan])
    ).numpy().tolist() == [-1.0, 0.0, 1.0, 0.0]


def test_tensorboard_layout_groups_the_gradient_panels(hand_run):
    from tensorboard.plugins.custom_scalar import layout_pb2

    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    # No loss-scale category without a LossScaleOptimizer.
    (category,) = layout.category
    assert category.title == "Gradient panels"
    charts = {c.title: list(c.multiline.tag) for c in category.chart}
    assert charts == {
        "Global gradient norm, log10": ["^log10_grad_norm/global$"],
        "Non-finite steps (1: NaN or inf)": ["^gradients/nonfinite$"],
        "00 dense_0: gradient norm, log10": ["^log10_grad_norm/00_dense_0$"],
    }


def test_tensorboard_heatmap_is_a_labelled_figure(hand_run):
    log_dir, _ = hand_run
    acc = read_run(os.path.join(log_dir, "train"))
    (event,) = acc.Tensors("gradients/heatmap")
    width, height, png = tf.make_ndarray(event.tensor_proto)
    image = tf.io.decode_png(png).numpy()
    # 10 x (2 + 0.32 * 1 layer) inches at 100 dpi.
    assert (int(width), int(height)) == (1000, 232) and image.shape == (232, 1000, 3)
    # Finite norms only: the NaN red is only in the legend's small patch
    # (a NaN cell would be a sixth of the plot, as in the test above).
    assert (image == [255, 0, 0]).all(axis=-1).sum() < 500
    # log10 of 15, 7.5, 3.75 span 0.6 decade, widened to 1 about the
    # middle: neither end color, the middle column near viridis's middle.
    assert heatmaps.color_range(np.log10([[15.0, 7.5, 3.75]])) == pytest.approx(
        (np.log10(7.5) - 0.5, np.log10(7.5) + 0.5)
    )
    # So the three cells, steps 1 to 3 left to right, are viridis at
    # 0.5 + log10(2) = 0.801, 0.5 and 0.5 - log10(2) = 0.199 (matplotlib's
    # `colormaps["viridis"]`, times 255, rounded); each fills a cell of about
    # 190 x 59 pixels.
    colors = {15.0: [124, 210, 80], 7.5: [33, 145, 140], 3.75: [65, 66, 135]}
    where = {v: np.nonzero((image == c).all(axis=-1)) for v, c in colors.items()}
    assert all(len(rows) > 10_000 for rows, _ in where.values())
    (left_rows, left), (_, right) = where[15.0], where[3.75]
    row, middle = int(np.median(left_rows)), int((left.mean() + right.mean()) / 2)
    assert left.max() < middle < right.min()
    assert image[row, middle].tolist() == colors[7.5]


def test_heatmap_color_range_ignores_a_spike():
    # 34 healthy steps near 1e-2 and one spike of 2.9e8 in each of 3
    # layers (1 in 35 cells): the 95th percentile stays below the spike,
    # so the healthy cells keep the color scale.
    logs = np.full((3, 35), -2.0)
    logs[:, :34] += np.linspace(-1.0, 1.0, 34)  # -3 .. -1
    logs[:, 34] = np.log10(2.9e8)
    low, high = heatmaps.color_range(logs)
    finite = np.sort(logs.ravel())
    assert low == pytest.approx(np.percentile(finite, 5))
    assert high == pytest.approx(np.percentile(finite, 95)) and high < -1.0
    # Zeros (-inf) and NaN are left out; nothing finite: a unit range.
    assert heatmaps.color_range([[-np.inf, np.nan, 1.0, 3.0]]) == pytest.approx((1.1, 2.9))
    assert heatmaps.color_range([[np.nan]]) == (-0.5, 0.5)


def test_heatmap_column_edges_and_first_nonfinite():
    # Columns end at steps 4, 8, 10: they cover (0, 4], (4, 8], (8, 10].
    assert heatmaps.column_edges([4, 8, 10]).tolist() == [0.0, 4.0, 8.0, 10.0]
    assert heatmaps.column_edges([7]).tolist() == [6.0, 7.0]
    columns = np.array([[1.0, 1.0], [1.0, 1.0], [np.nan, 1.0], [np.inf, np.nan]])
    assert heatmaps.first_nonfinite(columns, [1, 2, 3, 4]) == (3, 0)
    columns[2, 0] = 1.0
    assert heatmaps.first_nonfinite(columns, [1, 2, 3, 4]) == (4, 0)
    assert heatmaps.first_nonfinite(np.ones((2, 2)), [1, 2]) is None


def test_heatmap_marks_zero_and_nonfinite_and_merges_columns_evenly():
    rgb = heatmaps.colorize(np.array([[1.0, 100.0, 0.0, np.nan, np.inf]]))
    assert rgb[0].tolist() == [
        [68, 1, 84],
        [253, 231, 37],
        [0, 0, 0],
        [255, 0, 0],
        [255, 0, 0],
    ]
    # Two layers, 14 steps, at most 4 columns. Step 5 makes 5 columns: the
    # span doubles to 2 (columns 1-2, 3-4; step 5 pending). Step 9 makes 5
    # again: span 4 (columns 1-4, 5-8; step 9 pending). Steps 9-12 fill a
    # third column and 13-14 are pending, shown last. Each column is the
    # geometric mean of its steps: 10^mean(log10).
    layer_a = [1, 100, 10, 10, 1000, 1000, 1, 100, 10, 10, 10, 10, 10, 1000]
    layer_b = [0, 1, 1, 1, np.nan, 1, 1, 1, 0, np.inf, 1, 1, 1, 1]
    heatmap = heatmaps.Heatmap(max_columns=4)
    for step, norms in enumerate(zip(layer_a, layer_b), start=1):
        heatmap.add(step, norms)
        if step == 5:
            assert heatmap.steps == [2, 4, 5] and heatmap.span == 2
    assert heatmap.steps == [4, 8, 12, 14] and heatmap.span == 4
    columns = np.array(heatmap.columns)
    # Layer a: logs (0+2+1+1)/4 = 1, (3+3+0+2)/4 = 2, 1, pending (1+3)/2 = 2.
    np.testing.assert_array_equal(columns[:, 0], [10.0, 100.0, 10.0, 100.0])
    # Layer b: a zero makes 0; a NaN, or an inf beside a zero, non-finite.
    assert columns[0, 1] == 0.0 and columns[3, 1] == 1.0
    assert np.isnan(columns[1, 1]) and np.isnan(columns[2, 1])
    # 2 layers x 4 columns of 16 x 16 pixels; finite log10 norms from 0
    # (bottom of viridis) to 2 (top): 1 is its middle.
    image = heatmap.image()[0]
    assert image.shape == (32, 64, 3)
    assert image[8, ::16].tolist() == [[32, 144, 140], [253, 231, 37]] * 2
    assert image[24, ::16].tolist() == [[0, 0, 0], [255, 0, 0], [255, 0, 0], [68, 1, 84]]


def test_heatmap_columns_of_a_long_run_cover_equal_spans():
    # 3000 steps over at most 1024 columns: 1024 < 3000 <= 4096, so the span
    # is 4: 750 full columns of 4 steps each, no pending one. The geometric
    # mean of steps 4k-3 .. 4k with norm 10^step is 10^(4k - 1.5).
    heatmap = heatmaps.Heatmap(max_columns=1024)
    for step in range(1, 3001):
        heatmap.add(step, [10.0 ** (step / 1000.0)])
    assert heatmap.steps == list(range(4, 3001, 4))
    assert len(heatmap.columns) == 750 and heatmap.span == 4
    np.testing.assert_allclose(
        np.array(heatmap.columns)[:, 0],
        10.0 ** ((np.arange(4, 3001, 4) - 1.5) / 1000.0),
        rtol=1e-12,
    )
    heatmap.add(3001, [1.0])  # a partial column of 1 step, shown last
    assert heatmap.steps[-2:] == [3000, 3001] and len(heatmap.columns) == 751


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
        while "gradients/global_norm" not in scalar_tags.get("train", {}):
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()
            assert time.monotonic() < deadline, "TensorBoard did not serve the logs"
            time.sleep(0.5)
            try:
                scalar_tags = get("/data/plugin/scalars/tags")
            except OSError:
                pass
        assert {
            "gradients/layer_norm/dense_0",
            "gradients/global_norm",
            "gradients/nonfinite",
            "log10_grad_norm/00_dense_0",
            "log10_grad_norm/global",
        } <= set(scalar_tags["train"])
        histogram_tags = get("/data/plugin/histograms/tags")
        assert {"dense_0/kernel/gradient", "dense_0/kernel/histogram"} <= set(
            histogram_tags["train"]
        )
        layout = get("/data/plugin/custom_scalars/layout")
        (category,) = layout["category"]
        assert category["title"] == "Gradient panels"
        per_layer = category["chart"][2]["multiline"]["tag"][0]
        # The layer's panel picks exactly its log10 norm.
        matched = get(
            "/data/plugin/custom_scalars/scalars?run=train&tag=" + urllib.request.quote(per_layer)
        )
        assert list(matched["tag_to_events"]) == ["log10_grad_norm/00_dense_0"]
        values = [e[2] for e in matched["tag_to_events"]["log10_grad_norm/00_dense_0"]]
        assert values == [float(np.float32(np.log10(v))) for v in (15.0, 7.5, 3.75)]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log_file.close()


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
            written = scalars(acc, f"gradients/layer_norm/{layer}")
            assert [s for s, _ in written] == steps
            np.testing.assert_allclose(
                [v for _, v in written], [reference[s][layer] for s in steps], rtol=1e-6
            )
        written = scalars(acc, "gradients/global_norm")
        np.testing.assert_allclose([v for _, v in written], [globals_[s] for s in steps], rtol=1e-6)
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
    norms = scalars(acc, "gradients/global_norm")
    assert norms[0] == (1, 15.0) and norms[2] == (3, 7.5) and np.isnan(norms[1][1])
    assert scalars(acc, "gradients/nonfinite") == [(1, 0.0), (2, 1.0), (3, 0.0)]
    assert scalars(acc, "gradients/skipped_steps") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert scalars(acc, "gradients/loss_scale") == [(1, 8.0), (2, 4.0), (3, 4.0)]
    # The NaN step's log10 norms are NaN (TensorBoard marks them).
    log10 = scalars(acc, "log10_grad_norm/00_dense_0")
    assert log10[0] == (1, float(np.float32(np.log10(15.0)))) and np.isnan(log10[1][1])
    # The loss scale has its own category, only in this run's layout.
    from tensorboard.plugins.custom_scalar import layout_pb2

    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    assert [c.title for c in layout.category] == ["Gradient panels", "Gradient panels: loss scale"]
    (chart,) = layout.category[1].chart
    assert list(chart.multiline.tag) == ["^gradients/loss_scale$"]
    skipped = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert skipped["Non-finite steps (1: NaN or inf) and steps skipped by the loss scale"] == [
        "^gradients/nonfinite$",
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
    assert scalars(acc, "gradients/global_norm") == [(4, 15.0), (10, 15.0)]
    assert scalars(acc, "gradients/nonfinite") == [(4, 0.0), (10, 0.0)]
    assert scalars(acc, "gradients/skipped_steps") == [(5, 1.0), (10, 1.0)]
    assert scalars(acc, "gradients/loss_scale") == [(5, 4.0), (10, 4.0)]


# GradientMonitor -----------------------------------------------------------


def sqrt_model():
    """a -> sqrt -> b: at x = 0, only layer `a` gets a NaN gradient.

    d sqrt(z)/dz = 1 / (2 sqrt(0)) = inf, times x = 0 -> NaN for a's
    kernel; b's kernel gets sqrt(0) * dL/dout = 0.
    """
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="a")(inputs)
    hidden = keras.layers.Lambda(keras.ops.sqrt, name="root")(hidden)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="b")(hidden)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_monitor_stops_a_nan_run_and_names_the_layer():
    model = sqrt_model()
    x = np.array([[1.0], [4.0], [0.0], [0.0], [1.0], [1.0]])
    monitor = callbacks.GradientMonitor(action="stop")
    with pytest.warns(UserWarning, match=r"Step 2: non-finite .* 1 of 2 layers.*'a'\. Stopping"):
        history = model.fit(
            x, np.ones_like(x), batch_size=2, shuffle=False, verbose=0, callbacks=[monitor]
        )
    assert int(model.optimizer.iterations.numpy()) == 2  # batch 3 never ran
    assert len(history.history["loss"]) == 1
    (event,) = monitor.events
    assert (event["kind"], event["step"], event["layers"]) == ("nonfinite", 2, ["a"])


def test_monitor_lists_nonfinite_layers_in_forward_order():
    model = two_layer_model(names=("z_first", "a_second"))
    x = np.array([[np.nan, 1.0]])
    monitor = callbacks.GradientMonitor(action="warn")
    with pytest.warns(UserWarning, match=r"'z_first', 'a_second'"):
        model.fit(x, np.ones((1, 1)), verbose=0, callbacks=[monitor])
    assert monitor.events[0]["layers"] == ["z_first", "a_second"]


def test_monitor_waits_for_the_loss_scale_then_raises():
    # Every batch is NaN. Scale 4 -> 2 -> 1 -> 0.5: only the third skipped
    # step leaves the scale below min_loss_scale=1.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    model = hand_model(optimizer=optimizer)
    x, y = hand_data(5)
    y[:] = np.nan
    monitor = callbacks.GradientMonitor(action="raise")
    with pytest.raises(RuntimeError, match=r"Step 3: .*'dense_0'.*fell to 0\.5"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert float(optimizer.dynamic_scale.numpy()) == 0.5
    assert int(optimizer.iterations.numpy()) == 0


def test_monitor_reports_vanishing_layer_after_n_steps():
    # b's kernel is 0, so a's gradient (through b) is 0; lr 0 keeps it so.
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="a")(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="b")(hidden)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.ones((4, 1))
    monitor = callbacks.GradientMonitor(vanishing_threshold=1e-6, vanishing_steps=3)
    with pytest.warns(UserWarning, match=r"Step 3: vanishing gradients: .*'a' \(0\).*3 checks"):
        model.fit(x, np.ones_like(x), batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [
        ("vanishing", 3, ["a"])
    ]


def test_monitor_reports_explosions_by_threshold_and_by_median():
    # lr 0 keeps w = 3; batch k is c * [[1], [2]] so the gradient is 15 c^2:
    # 15 for 11 batches, then 1500 (c = 10).
    model = hand_model(lr=0.0)
    x, y = hand_data(12)
    x[22:] *= 10.0
    by_threshold = callbacks.GradientMonitor(exploding_threshold=100.0)
    by_median = callbacks.GradientMonitor(exploding_factor=10.0, median_window=50)
    with pytest.warns(UserWarning) as caught:
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[by_threshold, by_median])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert (
        "Step 12: exploding gradients: global norm 1500 is above exploding_threshold=100"
        in messages[0]
    )
    assert "exploding_factor=10 times the median of the last 11 (15)" in messages[1]
    assert "'dense_0' (1500)" in messages[1]
    for monitor in (by_threshold, by_median):
        assert [(e["kind"], e["step"]) for e in monitor.events] == [("exploding", 12)]


# GradientSnapshot ----------------------------------------------------------


def test_snapshot_files_equal_the_kept_gradients(tmp_path):
    model = two_layer_model()
    x = np.arange(8, dtype="float32").reshape(4, 2)
    tape = tape_gradients(two_layer_model(cls=keras.Model), x, np.ones((4, 1)), 1, 2)
    recorder = Recorder()
    every = callbacks.GradientSnapshot(tmp_path / "every" / "g-{step:03d}.npz", every=2)
    latest = callbacks.GradientSnapshot(tmp_path / "latest.npz")
    model.fit(
        x,
        np.ones((4, 1)),
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, every, latest],
    )
    assert [os.path.basename(f) for f in every.files] == [f"g-{s:03d}.npz" for s in (2, 4, 6, 8)]
    for filename, step in zip(every.files, (2, 4, 6, 8)):
        with np.load(filename) as data:
            assert int(data["step"]) == step and int(data["epoch"]) == (step - 1) // 4 + 1
            assert float(data["loss_scale"]) == 1.0
            kept = recorder.grads[step - 1]
            assert sorted(set(data.files) - {"step", "epoch", "loss_scale"}) == sorted(kept)
            for path, grad in kept.items():
                np.testing.assert_array_equal(data[path], grad)
                np.testing.assert_allclose(data[path], tape[step - 1][path], rtol=1e-6)
    # Without a field, each epoch replaces the file.
    assert latest.files == [str(tmp_path / "latest.npz")] * 2
    with np.load(latest.files[-1]) as data:
        assert int(data["step"]) == 8
        np.testing.assert_array_equal(data["dense_1/kernel"], recorder.grads[-1]["dense_1/kernel"])
    assert not glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True)


def test_keep_every_callbacks_read_each_kept_step_once_at_its_step(tmp_path):
    # keep_every=2 writes the slots on steps 1, 3 and 5 only: 5w = 15, 3.75
    # and 0.9375 (w halves every step). Between writes the slots hold the
    # last written step; callbacks read each written step once, at its step.
    model = hand_model(keep_every=2, metrics=[kg.metrics.GradientNorm(reduction="mean")])
    board = callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=1)
    snapshot = callbacks.GradientSnapshot(tmp_path / "snap" / "{step}.npz", every=1)
    # 15 and 3.75 are below 20; vanishing for 2 checks in a row is reported
    # at step 3, not at step 2 (a second look at step 1's gradients).
    monitor = callbacks.GradientMonitor(vanishing_threshold=20.0, vanishing_steps=2)
    recorder = Recorder()
    x, y = hand_data(5)
    # (`pytest.warns` would re-raise Keras's TensorBoard deprecation warnings.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=2,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[board, snapshot, monitor, recorder],
        )
    assert [str(w.message)[:46] for w in caught if w.category is UserWarning] == [
        "GradientMonitor: Step 3: vanishing gradients: "
    ]
    assert [float(g["dense_0/kernel"][0, 0]) for g in recorder.grads] == [
        15.0,
        15.0,
        3.75,
        3.75,
        0.9375,
    ]
    expected = [(1, 15.0), (3, 3.75), (5, 0.9375)]
    acc = read_run(str(tmp_path / "logs" / "train"))
    assert scalars(acc, "gradients/layer_norm/dense_0") == expected
    assert [os.path.basename(f) for f in snapshot.files] == ["1.npz", "3.npz", "5.npz"]
    for filename, (step, value) in zip(snapshot.files, expected):
        with np.load(filename) as data:
            assert int(data["step"]) == step
            assert data["dense_0/kernel"].tolist() == [[value]]
    assert [(e["kind"], e["step"]) for e in monitor.events] == [("vanishing", 3)]
    # Metrics see every step's gradients, written or not: the epoch's mean is
    # (15 + 7.5 + 3.75 + 1.875 + 0.9375) / 5, not (15 + 15 + 3.75 + ...) / 5.
    assert history.history["grad_norm"] == [5.8125]


def test_keep_every_labels_a_read_step_with_the_epoch_it_ran_in(tmp_path):
    # 5 batches per epoch, epochs 2 and 3 (initial_epoch=2), lr 0: 5w = 15,
    # but batch 5 of each epoch is doubled: 15 * 2^2 = 60. keep_every=2
    # writes steps 1, 3, 5, 7, 9; checks every 3 batches, after steps 3, 6
    # and 9, read steps 3, 5 and 9. Step 5 is epoch 2's last batch, read
    # while epoch 3 runs: it is labelled epoch 2 (file "e3", 1-based).
    model = hand_model(lr=0.0, keep_every=2)
    x, y = hand_data(5)
    x[8:] *= 2.0
    snapshot = callbacks.GradientSnapshot(tmp_path / "e{epoch}_s{step}.npz", every=3)
    monitor = callbacks.GradientMonitor(exploding_threshold=40.0, check_freq=3)
    with pytest.warns(UserWarning, match=r"Step 5: exploding gradients: global norm 60 "):
        model.fit(
            x,
            y,
            batch_size=2,
            epochs=4,
            initial_epoch=2,
            shuffle=False,
            verbose=0,
            callbacks=[snapshot, monitor],
        )
    found = []
    for filename in snapshot.files:
        with np.load(filename) as data:
            found.append(
                (
                    os.path.basename(filename),
                    int(data["step"]),
                    int(data["epoch"]),
                    float(data["dense_0/kernel"][0, 0]),
                )
            )
    assert found == [
        ("e3_s3.npz", 3, 3, 15.0),
        ("e3_s5.npz", 5, 3, 60.0),
        ("e4_s9.npz", 9, 4, 15.0),
    ]
    assert [(e["kind"], e["step"], e["epoch"]) for e in monitor.events] == [("exploding", 5, 2)]


def test_keep_every_labels_across_executions_and_fits(tmp_path):
    # keep_every=3 and steps_per_execution=2: callbacks run after steps 2, 4
    # of each fit. The count of steps goes on across fits: writes on global
    # steps 1, 4, 7 (5w: 15, 1.875, 0.234375; w halves every step).
    model = hand_model(keep_every=3, steps_per_execution=2)
    x, y = hand_data(4)

    def fit(name):
        snapshot = callbacks.GradientSnapshot(tmp_path / name / "{step}.npz", every=1)
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot])
        found = []
        for filename in snapshot.files:
            with np.load(filename) as data:
                found.append(
                    (
                        os.path.basename(filename),
                        int(data["step"]),
                        float(data["dense_0/kernel"][0, 0]),
                    )
                )
        return found

    # Fit 1: after step 2 the slots hold step 1's (one step old), after
    # step 4 step 4's.
    assert fit("first") == [("1.npz", 1, 15.0), ("4.npz", 4, 1.875)]
    # Fit 2 (global steps 5-8): after its step 2 the slots still hold fit
    # 1's step 4, which is not this fit's and is skipped; after its step 4,
    # global step 7, its step 3.
    assert fit("second") == [("3.npz", 3, 0.234375)]


@pytest.mark.parametrize("own_step", [False, True], ids=["keras_step", "own_step"])
@pytest.mark.parametrize("mode", list(MODES))
def test_callbacks_of_a_model_built_by_its_first_batch(tmp_path, mode, own_step):
    # 5w = 15, then w = 3 - 0.1 * 15 = 1.5 and 5w = 7.5.
    model = LateBuilt(own_step=own_step, name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **MODES[mode])
    snapshot = callbacks.GradientSnapshot(tmp_path / "g_{step}.npz", every=1)
    board = callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=1)
    monitor = callbacks.GradientMonitor(exploding_threshold=10.0)
    x, y = hand_data(2)
    # (`pytest.warns` would re-raise Keras's TensorBoard deprecation warnings.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot, board, monitor]
        )
    assert [str(w.message)[:56] for w in caught if w.category is UserWarning] == [
        "GradientMonitor: Step 1: exploding gradients: global nor"
    ]
    assert snapshot.files == [str(tmp_path / "g_1.npz"), str(tmp_path / "g_2.npz")]
    found = []
    for filename in snapshot.files:
        with np.load(filename) as data:
            assert sorted(data.files) == ["epoch", "loss_scale", "net/dense_0/kernel", "step"]
            found.append(
                (
                    int(data["step"]),
                    int(data["epoch"]),
                    float(data["loss_scale"]),
                    data["net/dense_0/kernel"].tolist(),
                )
            )
    assert found == [(1, 1, 1.0, [[15.0]]), (2, 1, 1.0, [[7.5]])]
    acc = read_run(str(tmp_path / "logs" / "train"))
    assert scalars(acc, "gradients/layer_norm/net/dense_0") == [(1, 15.0), (2, 7.5)]
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [
        ("exploding", 1, ["net/dense_0"])
    ]


def test_snapshot_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    model = hand_model()
    x, y = hand_data(2)
    target = tmp_path / "latest.npz"
    snapshot = callbacks.GradientSnapshot(target, every=1)
    real_savez = np.savez
    calls = []

    def savez_then_fail(file, **arrays):
        calls.append(arrays["step"])
        if len(calls) == 2:  # Half a file, then the disk is full.
            file.write(b"PK\x03\x04 partial")
            raise OSError(28, "No space left on device")
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.warns(UserWarning, match="could not write .*No space left"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot])
    assert snapshot.files == [str(target)]
    with np.load(target) as data:  # still the whole first snapshot
        assert int(data["step"]) == 1 and float(data["dense_0/kernel"][0, 0]) == 15.0
    assert os.listdir(tmp_path) == ["latest.npz"]


def test_snapshot_removes_only_its_own_stale_temporaries(tmp_path):
    # A process killed mid-write leaves `.<file name>.<12 hex>.tmp`; the
    # next `fit` removes those of the files it would write, nothing else.
    stale = [".g_042.npz.0123456789ab.tmp", ".g_7.npz.fedcba987654.tmp"]
    kept = [
        ".other.tmp",
        "g_1.npz",
        "notes.txt",
        ".g_042.npz.0123456789ab.tmp.bak",  # not a temporary's name
        ".g_x.npz.0123456789ab.tmp",  # not a step
        ".h_042.npz.0123456789ab.tmp",  # another file's
        ".g_042.npz.0123456789a.tmp",  # 11 hex digits
        "g_042.npz.0123456789ab.tmp",  # not hidden
    ]
    for name in stale + kept:
        (tmp_path / name).write_text(name)
    # With `{epoch}` in the directory: each epoch's directory that exists.
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / ".g.npz.00000000abcd.tmp").write_text("stale")
    (tmp_path / "e1" / "g.npz").write_text("an earlier file")
    model = hand_model()
    x, y = hand_data(1)
    steps = callbacks.GradientSnapshot(tmp_path / "g_{step:03d}.npz", every=1)
    epochs = callbacks.GradientSnapshot(tmp_path / "e{epoch}" / "g.npz", every="epoch")
    fit_begins = []

    class AtBegin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            fit_begins.append(sorted(os.listdir(tmp_path)))

    model.fit(x, y, batch_size=2, verbose=0, callbacks=[steps, epochs, AtBegin()])
    assert fit_begins == [sorted(kept + ["e1"])]  # gone before the first step
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["e1", "g_001.npz"])
    for name in kept:
        assert (tmp_path / name).read_text() == name
    assert os.listdir(tmp_path / "e1") == ["g.npz"]
    with np.load(tmp_path / "g_001.npz") as data:
        assert data["dense_0/kernel"].tolist() == [[15.0]]


# Bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: callbacks.GradientTensorBoard(update_freq=0),
            "`update_freq` must be 'epoch', 'batch' or a positive int. Received: update_freq=0",
        ),
        (
            lambda: callbacks.GradientTensorBoard(update_freq="often"),
            "Received: update_freq='often'",
        ),
        (
            lambda: callbacks.GradientTensorBoard(update_freq=True),
            "Received: update_freq=True",
        ),
        (
            lambda: callbacks.GradientTensorBoard(histogram_freq=-1),
            "`histogram_freq` must be a non-negative int (0 disables it). "
            "Received: histogram_freq=-1",
        ),
        (
            lambda: callbacks.GradientTensorBoard(gradient_histogram_freq="epoch"),
            "`gradient_histogram_freq` must be 'batch' or a positive int. "
            "Received: gradient_histogram_freq='epoch'",
        ),
        (
            lambda: callbacks.GradientMonitor(action="panic"),
            "`action` must be one of ['warn', 'stop', 'raise']. Received: action='panic'",
        ),
        (
            lambda: callbacks.GradientMonitor(vanishing_threshold=-1e-6),
            "`vanishing_threshold` must be a finite number above 0 or None (off). "
            "Received: vanishing_threshold=-1e-06",
        ),
        (
            lambda: callbacks.GradientMonitor(exploding_factor=0.5),
            "`exploding_factor` must be a finite number above 1 or None (off). "
            "Received: exploding_factor=0.5",
        ),
        (
            lambda: callbacks.GradientMonitor(exploding_threshold=float("inf")),
            "Received: exploding_threshold=inf",
        ),
        (
            lambda: callbacks.GradientMonitor(vanishing_steps=0),
            "`vanishing_steps` must be a positive int. Received: vanishing_steps=0",
        ),
        (
            lambda: callbacks.GradientMonitor(check_freq="epoch"),
            "`check_freq` must be a positive int. Received: check_freq='epoch'",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads.npy"),
            "`path` must end in '.npz'",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{batch}.npz"),
            "`path` may only hold the fields {step} and {epoch}",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{step[0]}.npz"),
            "`path` may only hold the fields {step} and {epoch} (with format "
            "specs like {step:06d}). Received: path='grads-{step[0]}.npz' "
            "(TypeError: 'int' object is not subscriptable)",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{epoch.x}.npz"),
            "Received: path='grads-{epoch.x}.npz' (AttributeError: ",
        ),
        (
            lambda: callbacks.GradientSnapshot("g.npz", every=-2),
            "`every` must be 'epoch' or a positive int. Received: every=-2",
        ),
    ],
)
def test_invalid_arguments_raise_keras_style_errors(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize("path", [None, 3])
def test_a_snapshot_path_of_the_wrong_type_is_named(path):
    match = (
        r"`path` must be a str or os.PathLike naming an '.npz' file .*"
        rf"Received: path={path} of type {type(path).__name__}"
    )
    with pytest.raises(TypeError, match=match):
        callbacks.GradientSnapshot(path)


@pytest.mark.parametrize("kind", ["tensorboard", "snapshot"])
def test_unwritable_path_fails_before_training(tmp_path, kind):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    if kind == "tensorboard":
        callback = callbacks.GradientTensorBoard(blocker / "logs")
        match = r"`log_dir` must be a path this process can write to\. Received: log_dir="
    else:
        callback = callbacks.GradientSnapshot(blocker / "g.npz")
        match = r"`path` must be a path this process can write to\. Received: path="
    model = hand_model()
    x, y = hand_data(1)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0
    assert float(model.get_layer("dense_0").kernel.numpy()[0, 0]) == 3.0


def test_callbacks_need_a_model_that_keeps_gradients(tmp_path):
    inputs = keras.Input((1,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile(optimizer="sgd", loss="mse")
    x, y = hand_data(1)
    with pytest.raises(
        TypeError, match=r"GradientMonitor needs a model that keeps gradients.*Functional"
    ):
        plain.fit(x, y, verbose=0, callbacks=[callbacks.GradientMonitor()])
    board = callbacks.GradientTensorBoard(tmp_path / "logs")
    with pytest.raises(TypeError, match=r"GradientTensorBoard needs a model that keeps"):
        plain.fit(x, y, verbose=0, callbacks=[board])
    assert not (tmp_path / "logs").exists()  # no log directory for a plain model
    model = hand_model()
    model.keep_gradients = False
    with pytest.raises(ValueError, match=r"GradientSnapshot .*`keep_gradients=False`"):
        model.fit(x, y, verbose=0, callbacks=[callbacks.GradientSnapshot(tmp_path / "g.npz")])


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
    assert scalars(acc, "gradients/nonfinite") == [(1, 0.0), (2, 1.0)][: len(steps)]
    assert [e.step for e in acc.Tensors("batch_loss")] == steps


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
