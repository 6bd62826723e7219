"""The per-step statistics the callbacks read, on every backend.

`tests/test_stats.py` runs these cases on every backend: on each, the
callbacks' norms come from the statistics the training step computed
(`_stats.read`), never from the kept gradients, except on a non-finite step.

The two-layer model: x -> Dense(1, w_a = 1.5) -> Dense(1, w_b = 2), no
biases, x = [[1], [2]], y = 0, mse, SGD(0.0) (every step the same). With
pred = w_a w_b x, dL/dpred_i = pred_i (mean over 2 samples of the square),
so dL/dw_b = sum_i pred_i w_a x_i = 5 w_a^2 w_b = 22.5 and dL/dw_a =
5 w_a w_b^2 = 30: sums of squares 506.25 and 900, global norm
sqrt(1406.25) = 37.5.
"""

import contextlib
import warnings

import keras
import numpy as np

import keras_keepgrad as kg
from keras_keepgrad import _squares
from keras_keepgrad import _stats
from keras_keepgrad.callbacks import panels

X = np.array([[1.0], [2.0]], dtype="float32")
PATHS = ("dense_a/kernel", "dense_b/kernel")


class Squares(keras.callbacks.Callback):
    """Records `_stats.read` after each batch, sharing the batch's read."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        count, paths, squares = _stats.read(self.model, logs)
        self.seen.append((count, paths, squares.tolist()))


def _refuse_slot_reads(monkeypatch):
    """Makes reading the norms from the kept gradients fail the test."""

    def refused(self, grads_by_path):
        raise AssertionError("a callback read the norms from the kept gradients")

    monkeypatch.setattr(_squares.GradientNorms, "__call__", refused)


@contextlib.contextmanager
def _reports_warned():
    """Lets `GradientMonitor`'s warnings pass (its `events` are checked)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GradientMonitor: Step", category=UserWarning)
        warnings.filterwarnings("ignore", message="GradientMonitor: summary", category=UserWarning)
        yield


def _log10(norm):
    return float(np.float32(np.log10(norm)))


def _tensorboard_values(log_dir, tag):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(
        str(log_dir / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


def two_layers(**compile_kwargs):
    inputs = keras.Input((1,))
    h = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(1.5), name="dense_a"
    )(inputs)
    outputs = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(2.0), name="dense_b"
    )(h)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **compile_kwargs)
    return model


def metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch, **compile_kwargs):
    _refuse_slot_reads(monkeypatch)
    model = two_layers(metrics=[kg.metrics.GradientNorm()], **compile_kwargs)
    seen = Squares()
    monitor = kg.callbacks.GradientMonitor(exploding_threshold=37.0)
    tensorboard = kg.callbacks.GradientTensorBoard(
        str(tmp_path), update_freq=1, write_heatmap=False
    )
    with _reports_warned():
        history = model.fit(
            np.tile(X, (2, 1)),
            np.zeros((4, 1), "float32"),
            batch_size=2,
            shuffle=False,
            verbose=0,
            callbacks=[tensorboard, monitor, seen],
        )
    assert seen.seen == [(1, PATHS, [900.0, 506.25]), (2, PATHS, [900.0, 506.25])]
    assert history.history["grad_norm"] == [37.5]
    # TensorBoard holds the norms' log10, in float32.
    assert _tensorboard_values(tmp_path, panels.GLOBAL_NORM_TAG) == [_log10(37.5)] * 2
    assert _tensorboard_values(tmp_path, panels.layer_norm_tag("dense_a")) == [_log10(30.0)] * 2
    assert _tensorboard_values(tmp_path, panels.layer_norm_tag("dense_b")) == [_log10(22.5)] * 2
    # 37.5 is above the threshold from the first step on: reported once.
    assert [(e["kind"], e["step"]) for e in monitor.events] == [("exploding", 1)]
    assert "global norm 37.5" in monitor.events[0]["message"]


def keep_every_describes_the_step_the_slots_hold(monkeypatch, **compile_kwargs):
    # The one-weight model, SGD(0.1): 5w = 15, 7.5, 3.75. Steps 1 and 3
    # write the slots; after step 2 they, and the statistics, hold step 1.
    _refuse_slot_reads(monkeypatch)
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
    )(inputs)
    model = kg.KeepGradModel(inputs, outputs, keep_every=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    seen = Squares()
    monitor = kg.callbacks.GradientMonitor(exploding_threshold=10.0)
    with _reports_warned():
        model.fit(np.tile(X, (3, 1)), np.zeros((6, 1), "float32"), batch_size=2,
                  shuffle=False, verbose=0, callbacks=[monitor, seen])  # fmt: skip
    assert seen.seen == [
        (1, ("dense_0/kernel",), [225.0]),
        (1, ("dense_0/kernel",), [225.0]),
        (2, ("dense_0/kernel",), [14.0625]),
    ]
    # Step 1 (15) is checked once, at step 1; step 3 (3.75) is below.
    assert [(e["kind"], e["step"]) for e in monitor.events] == [("exploding", 1)]


def a_nonfinite_step_is_recorded_and_reported(tmp_path, **compile_kwargs):
    # x = [[nan], [2]]: the gradient 3 * (nan + 4) is NaN, and so its sum.
    model = two_layers(**compile_kwargs)
    seen = Squares()
    monitor = kg.callbacks.GradientMonitor()
    tensorboard = kg.callbacks.GradientTensorBoard(
        str(tmp_path), update_freq=1, write_heatmap=False
    )
    x = np.array([[1.0], [2.0], [np.nan], [2.0]], "float32")
    with _reports_warned():
        model.fit(x, np.zeros((4, 1), "float32"), batch_size=2, shuffle=False, verbose=0,
                  callbacks=[tensorboard, monitor, seen])  # fmt: skip
    assert seen.seen[0] == (1, PATHS, [900.0, 506.25])
    count, paths, squares = seen.seen[1]
    assert (count, paths) == (2, PATHS) and np.isnan(squares).all()
    assert _tensorboard_values(tmp_path, panels.NONFINITE_TAG) == [0.0, 1.0]
    assert _tensorboard_values(tmp_path, panels.GLOBAL_NORM_TAG)[0] == _log10(37.5)
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [
        ("nonfinite", 2, ["dense_a", "dense_b"])
    ]
