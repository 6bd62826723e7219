"""Tests for keras_keepgrad._stats and _squares: one step's statistics, computed once.

The hand model of tests/callbacks: one bias-free Dense(1), kernel 3, mse,
SGD(0.1), x = [[1], [2]], y = 0: the gradient is 5w = 15, 7.5, 3.75, so
the recorded sums of squares are 225, 56.25, 14.0625.
"""

import keras
import numpy as np
import pytest
import stats_cases
import tensorflow as tf

import keras_keepgrad as kg
from keras_keepgrad import _squares
from keras_keepgrad import _stats

# Unit tests of the sums of squares on TensorFlow's inputs: tf tensors,
# IndexedSlices, a tf.function (the model-level tests below run everywhere).
TF_ARITHMETIC = pytest.mark.backends("tensorflow", reason="tf tensors and IndexedSlices as inputs")


def hand_model(**compile_kwargs):
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(3.0),
        name="dense_0",
    )(inputs)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model


def hand_data(batches):
    x = np.tile(np.array([[1.0], [2.0]]), (batches, 1))
    return x, np.zeros_like(x)


class Squares(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        count, paths, squares = _stats.read(self.model)
        self.seen.append((count, paths, squares.tolist()))


@TF_ARITHMETIC
def test_gradient_norms_sum_squares_per_variable_and_layer():
    grads = {
        "a/kernel": tf.constant([[3.0, 4.0]]),  # 9 + 16
        "a/bias": tf.constant([1.0]),
        "b/kernel": tf.constant([2.0], tf.float64),
        # Duplicate rows add before squaring: (1 + 2)^2 + 4^2.
        "c/embeddings": tf.IndexedSlices(
            tf.constant([[1.0], [2.0], [4.0]]),
            tf.constant([0, 0, 1]),
            tf.constant([3, 1]),
        ),
    }
    squares = _squares.sum_squares(list(grads.values()))
    assert squares.dtype == tf.float64
    assert squares.numpy().tolist() == [25.0, 1.0, 4.0, 25.0]
    norms = _squares.GradientNorms(grads)(grads)
    assert _squares.GradientNorms(grads).layers == ("a", "b", "c")
    assert np.square(norms.layer_norms).tolist() == pytest.approx([26.0, 4.0, 25.0])
    assert norms.global_norm == pytest.approx(np.sqrt(55.0))
    assert not norms.nonfinite
    # Layers in the order they first appear in the paths.
    paths = ["c/embeddings", "b/kernel", "a/kernel", "a/bias"]
    norms = _squares.GradientNorms(paths).from_squares([25.0, 4.0, 25.0, 1.0])
    assert np.square(norms.layer_norms).tolist() == pytest.approx([25.0, 4.0, 26.0])
    norms = _squares.GradientNorms(paths).from_squares([25.0, np.inf, 25.0, np.nan])
    assert norms.layer_nonfinite.tolist() == [False, True, True] and norms.nonfinite


def test_layer_of_drops_the_last_path_component():
    assert _squares.layer_of("dense_0/kernel") == "dense_0"
    assert _squares.layer_of("encoder/dense/bias") == "encoder/dense"
    assert _squares.layer_of("scale") == "scale"


@TF_ARITHMETIC
@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_and_overflowing_sums_are_told_apart(jit):
    @tf.function(jit_compile=jit)
    def squares(a, b, c):
        return _squares.sum_squares([a, b, c])

    # 3e19^2 overflows float32 but not float64: summed again in float64.
    big, nan = tf.constant([3e19]), tf.constant([1.0, np.nan])
    values = squares(big, nan, tf.constant([2.0])).numpy()
    assert values[0] == pytest.approx(9e38) and np.isnan(values[1]) and values[2] == 4.0


def test_callbacks_read_the_recorded_statistics_every_step():
    model = hand_model()
    seen = Squares()
    x, y = hand_data(3)
    # GradientMonitor asks for the statistics in `set_model`.
    model.fit(
        x,
        y,
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[kg.callbacks.GradientMonitor(), seen],
    )
    assert seen.seen == [
        (1, ("dense_0/kernel",), [225.0]),
        (2, ("dense_0/kernel",), [56.25]),
        (3, ("dense_0/kernel",), [14.0625]),
    ]


def test_no_statistics_without_a_callback_that_asks():
    model = hand_model(metrics=[kg.metrics.GradientNorm()])
    x, y = hand_data(1)
    history = model.fit(x, y, batch_size=2, shuffle=False, verbose=0, epochs=2)
    assert history.history["grad_norm"] == [15.0, 7.5]
    assert _stats.read(model) is None
    # A later fit with a callback that asks remakes the training function.
    first = model.train_function
    seen = Squares()
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[kg.callbacks.GradientMonitor(), seen])
    assert model.train_function is not first
    assert seen.seen == [(1, ("dense_0/kernel",), [3.75**2])]


def test_keep_every_records_the_kept_steps_only():
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(3.0),
        name="dense_0",
    )(inputs)
    model = kg.KeepGradModel(inputs, outputs, keep_every=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    seen = Squares()
    x, y = hand_data(3)
    model.fit(
        x,
        y,
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[kg.callbacks.GradientMonitor(), seen],
    )
    # Steps 1 and 3 are kept (15, then 3.75); step 2 leaves step 1's.
    assert seen.seen == [
        (1, ("dense_0/kernel",), [225.0]),
        (1, ("dense_0/kernel",), [225.0]),
        (2, ("dense_0/kernel",), [14.0625]),
    ]


def test_statistics_are_no_weights_and_not_saved(tmp_path):
    model = hand_model()
    x, y = hand_data(1)
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[kg.callbacks.GradientMonitor()])
    n = len(model.weights)
    assert _stats.read(model)[0] == 1
    assert not any("statistics" in v.path for v in model.weights)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    plain = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    plain.load_weights(str(tmp_path / "w.weights.h5"))  # the same arrays
    assert len(model.weights) == n


@TF_ARITHMETIC
def test_metrics_and_statistics_share_one_computation():
    grads = {"a/kernel": tf.constant([3.0, 4.0])}
    first = _squares.shared_squares(grads)
    assert _squares.shared_squares(dict(grads)) is first  # same tensors
    other = {"a/kernel": tf.constant([3.0, 4.0])}
    assert _squares.shared_squares(other) is not first  # other tensors
    assert first.numpy().tolist() == [25.0]
    # The cache holds no strong reference: the gradients can be freed.
    import gc
    import weakref

    ref = weakref.ref(other["a/kernel"])
    del other
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "values, finite",
    [
        ([[3.0, 4.0], [12.0]], True),  # 25 + 144
        ([[3.0, 4.0], [np.nan]], False),
        ([[3.0, 4.0], [-np.inf]], False),
        # 2e19 squared is 4e38, beyond float32's 3.4e38: read as not finite
        # (readers look at the entries then).
        ([[2e19], [1.0]], False),
    ],
)
def test_shared_finite_is_whether_the_sums_of_squares_add_up_finite(values, finite):
    grads = {
        f"v{i}": keras.ops.convert_to_tensor(np.array(v, "float32")) for i, v in enumerate(values)
    }
    assert bool(keras.ops.convert_to_numpy(_squares.shared_finite(grads))) is finite


@TF_ARITHMETIC
def test_shared_finite_sums_the_shared_l2_losses():
    @tf.function(autograph=False)
    def step(a, b):
        grads = {"a": a, "b": b}
        squares = _squares.shared_squares(grads)
        return squares, _squares.shared_finite(grads)

    a, b = tf.constant([3.0, 4.0]), tf.constant([12.0])
    graph = step.get_concrete_function(a, b).graph
    # One `l2_loss` per gradient, read by the float64 sums and the check.
    assert [op.type for op in graph.get_operations()].count("L2Loss") == 2
    squares, finite = step(a, b)
    assert squares.numpy().tolist() == [25.0, 144.0]
    assert bool(finite)


def test_an_overflowing_sum_is_not_taken_for_nan(tmp_path):
    # x = [[1e10], [2e10]]: dL/dw = w * (1e20 + 4e20) = 1.5e21 at w = 3,
    # finite in float32, but its square (2.25e42) overflows float32: the
    # step records inf, and the callbacks sum the slots again in float64.
    model = hand_model()
    x, y = np.array([[1e10], [2e10]]), np.zeros((2, 1))
    # Non-finite gradients only: a norm of 1.5e21 is above the default
    # exploding_threshold, which is not what this checks.
    monitor = kg.callbacks.GradientMonitor(action="raise", exploding_threshold=None)
    seen = Squares()
    model.fit(
        x,
        y,
        batch_size=2,
        verbose=0,
        callbacks=[monitor, kg.callbacks.GradientTensorBoard(str(tmp_path), update_freq=1), seen],
    )
    assert seen.seen[0][2] == [np.inf]
    assert monitor.events == []
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    acc.Reload()

    def values(tag):
        return [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]

    assert values("gradients/nonfinite_steps") == [0.0]
    assert values("gradients/log10_global_norm") == [float(np.float32(np.log10(1.5e21)))]


@TF_ARITHMETIC
def test_sum_squares_without_the_exact_pass_reads_overflow_as_inf():
    squares = _squares.sum_squares([tf.constant([3e19]), tf.constant([2.0])], exact=False)
    assert squares.numpy().tolist() == [np.inf, 4.0]


@pytest.mark.not_compiled_on_torch(
    reason="a dense gradient on PyTorch: test_a_metric_and_two_callbacks_read_the_step_statistics"
)
@pytest.mark.parametrize("jit", [False, True], ids=["no_jit", "jit"])
def test_sparse_gradients_are_summed_before_squaring(jit):
    # Embedding(5, 3) of ones, Flatten, Dense(1) of ones, mse, y = 0.
    # x = [[1, 1], [2, 3]]: both predictions are 6, so each output's error
    # gradient is 2 * 6 / 2 = 6. d/kernel: 6 * the flattened embeddings
    # (all ones) summed over the 2 samples = 12 per entry, 6 entries:
    # 6 * 144 = 864. d/embeddings: row 1 gets 6 from each of its two
    # positions in sample 1 (12 per entry, duplicates summed), rows 2 and 3
    # get 6: 3 * 144 + 2 * 3 * 36 = 648.
    inputs = keras.Input((2,), dtype="int32")
    h = keras.layers.Embedding(5, 3, embeddings_initializer="ones", name="emb")(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False, name="d")(
        keras.layers.Flatten()(h)
    )
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=jit)
    seen = Squares()
    model.fit(
        np.array([[1, 1], [2, 3]], "int32"),
        np.zeros((2, 1), "float32"),
        batch_size=2,
        verbose=0,
        callbacks=[kg.callbacks.GradientMonitor(), seen],
    )
    assert seen.seen == [(1, ("emb/embeddings", "d/kernel"), [648.0, 864.0])]


# The cases of `stats_cases.py`, in every mode.


def test_a_metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch, mode):
    stats_cases.metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch, **mode)


@pytest.mark.not_compiled_on_torch(
    reason="the statistics' reads: test_a_metric_and_two_callbacks_read_the_step_statistics"
)
def test_step_statistics_under_keep_every_describe_the_kept_step(monkeypatch, mode):
    stats_cases.keep_every_describes_the_step_the_slots_hold(monkeypatch, **mode)


@pytest.mark.not_compiled_on_torch(
    reason="the statistics' reads: test_a_metric_and_two_callbacks_read_the_step_statistics"
)
def test_step_statistics_of_a_nonfinite_step(tmp_path, mode):
    stats_cases.a_nonfinite_step_is_recorded_and_reported(tmp_path, **mode)
