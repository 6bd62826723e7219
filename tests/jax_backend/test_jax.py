"""KeepGradModel on Keras's JAX backend (run with KERAS_BACKEND=jax).

`tests/test_backends.py` runs this directory, with the contract's test
modules (`conftest.CONTRACT`, the same on every backend), in a subprocess
with `KERAS_BACKEND=jax` and two host CPU devices; the TensorFlow run of the
suite does not collect it. Here: what is JAX's own (`jax.grad`
references, a stateless `train_step`, donated slots, `keras.distribution`).

The hand model: one bias-free Dense(1) with w = 3, x = [[1], [2]], y = 0,
mse. loss = mean((w*x)^2), so d/dw = 5w = 15; with SGD(0.1) w' = 1.5, then
5w' = 7.5, then 3.75.
"""

import os
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import W0
from conftest import Recorder
from conftest import X
from conftest import Y
from conftest import dense_0
from conftest import fit_batches
from conftest import fit_once
from conftest import kernel
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad import _compat

assert keras.backend.backend() == "jax", "run this directory with KERAS_BACKEND=jax"


def reference_grad(w):
    """`jax.grad` of the same loss, mean((w*x)^2), at `w`."""
    x = jnp.asarray(X)
    return float(jax.grad(lambda w: jnp.mean((w * x) ** 2))(jnp.float32(w)))


def test_reference_is_5w():
    assert reference_grad(W0) == 15.0


def test_functional_model_keeps_the_exact_gradient(mode):
    model = one_weight()
    history = fit_once(model, **mode)
    grad = kernel(model)
    assert isinstance(grad, jax.Array)
    assert float(grad[0, 0]) == reference_grad(W0) == 15.0
    w_after = float(model.get_weights()[0][0, 0])
    assert w_after == 1.5
    assert (W0 - w_after) / 0.1 == 15.0  # (w - w') / lr with SGD
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}
    assert list(model.get_gradients_by_path()) == ["dense_0/kernel"]
    assert history.history["loss"] == [22.5]  # mean(9, 36)


def test_three_steps_follow_the_weight(mode):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    rec = fit_batches(model, 3)
    assert rec.seen == [15.0, 7.5, 3.75]
    assert rec.seen == [reference_grad(w) for w in (3.0, 1.5, 0.75)]


def test_own_stateless_train_step_is_kept():
    # A JAX train_step of the user's own: grads of half the loss, so the
    # optimizer receives 7.5 and the kept gradient is 7.5.
    class Net(kg.KeepGradModel):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable):
                y_pred, _ = self.stateless_call(trainable, non_trainable, x)
                return 0.5 * jnp.mean((y_pred - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(trainable)
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    inputs = keras.Input((1,))
    model = Net(inputs, one_weight(cls=keras.Model).layers[-1](inputs))
    fit_once(model)
    assert float(kernel(model)[0, 0]) == 7.5
    assert float(model.get_weights()[0][0, 0]) == 2.25  # 3 - 0.1 * 7.5


def test_two_optimizers_in_own_train_step_are_both_kept():
    # A GAN-like step: each of two one-weight layers has its own optimizer
    # (SGD without momentum: no optimizer state to thread through).
    # y = w1 * w0 * x with w0 = 3, w1 = 1: d/dw0 = 5 * w0 * w1^2 = 15,
    # d/dw1 = 5 * w1 * w0^2 = 45.
    class Net(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = dense_0(name="first")
            self.second = dense_0(name="second", w=1.0)
            self.opt_a = keras.optimizers.SGD(0.01)
            self.opt_b = keras.optimizers.SGD(0.01)

        def call(self, x):
            return self.second(self.first(x))

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable):
                y_pred, _ = self.stateless_call(trainable, non_trainable, x)
                return jnp.mean((y_pred - y) ** 2)

            loss, (g0, g1) = jax.value_and_grad(loss_fn)(trainable)
            (w0,), _ = self.opt_a.stateless_apply(
                [v.value for v in self.opt_a.variables], [g0], [trainable[0]]
            )
            (w1,), _ = self.opt_b.stateless_apply(
                [v.value for v in self.opt_b.variables], [g1], [trainable[1]]
            )
            return {"loss": loss}, ([w0, w1], non_trainable, optimizer_vars, metrics_vars)

    net = Net(name="gan")
    net(X)
    net.opt_a.build([net.first.kernel])
    net.opt_b.build([net.second.kernel])
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    net.fit(X, Y, batch_size=2, verbose=0)
    assert float(net.gradients["gan"]["first"]["kernel"][0, 0]) == 15.0
    assert float(net.gradients["gan"]["second"]["kernel"][0, 0]) == 45.0


def test_keep_step_gradients_without_optimizer():
    class Net(kg.KeepGradModel):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable):
                y_pred, _ = self.stateless_call(trainable, non_trainable, x)
                return jnp.mean((y_pred - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(trainable)
            grads = self.keep_step_gradients(grads, self.trainable_variables)
            trainable = [v - 0.1 * g for v, g in zip(trainable, grads)]
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    inputs = keras.Input((1,))
    model = Net(inputs, one_weight(cls=keras.Model).layers[-1](inputs))
    fit_once(model)
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 1.5


# Eager steps ------------------------------------------------------------

EAGER_MODES = {"eager": dict(run_eagerly=True), "no_jit": dict(jit_compile=False)}
# How often Keras calls the layer in two eager batches: functional
# construction, its symbolic build, one call per batch. Keras before 3.12
# calls it once more (plain Keras as KeepGradModel).
KERAS_CALLS = 4 if _compat.KERAS_VERSION >= (3, 12) else 5


class HostSideDense(keras.layers.Layer):
    """The one-weight layer, doing host-side work in `call` once `active`.

    Counts its calls; while active (from `on_train_begin`, as a TensorBoard
    writer is), reads its input with `np.asarray`, which a tracer refuses.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.active = False
        self.seen = []

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(1, 1), initializer=keras.initializers.Constant(W0), name="kernel"
        )

    def call(self, x):
        self.calls += 1
        if self.active:
            self.seen.append(np.asarray(x).tolist())
        return keras.ops.matmul(x, self.kernel)


class Activate(keras.callbacks.Callback):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def on_train_begin(self, logs=None):
        self.layer.active = True


def _host_side_model(cls=kg.KeepGradModel, **options):
    """The one-weight model on a `HostSideDense`; returns it and the layer."""
    layer = HostSideDense(name="dense_0")
    inputs = keras.Input((1,))
    return cls(inputs, layer(inputs), **options), layer


def _fit_host_side(cls, mode, **options):
    """Fits two batches, the layer active from `on_train_begin`; returns
    the model, its layer and the `Recorder` (None for a `keras.Model`)."""
    model, layer = _host_side_model(cls, **options)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    rec = Recorder() if cls is kg.KeepGradModel else None
    model.fit(
        np.tile(X, (2, 1)),
        np.tile(Y, (2, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[Activate(layer)] + ([rec] if rec else []),
    )
    return model, layer, rec


@pytest.mark.parametrize("mode", list(EAGER_MODES))
def test_an_eager_step_calls_the_layers_as_keras_does(mode):
    # Asked for an eager step, the layers' `call` runs on arrays, exactly as
    # many times as in Keras: functional construction, Keras's symbolic
    # build, then once per batch; no trace for the slots' shapes.
    _, plain, _ = _fit_host_side(keras.Model, EAGER_MODES[mode])
    model, layer, rec = _fit_host_side(kg.KeepGradModel, EAGER_MODES[mode])
    assert layer.calls == plain.calls == KERAS_CALLS
    assert layer.seen == plain.seen == [[[1.0], [2.0]], [[1.0], [2.0]]]
    assert rec.seen == [15.0, 7.5]
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


@pytest.mark.parametrize("mode", list(EAGER_MODES))
def test_an_eager_own_train_step_runs_once_a_batch(mode):
    # A user's JAX step reading the loss on the host: it runs once a batch,
    # on arrays. Grads of half the loss: the optimizer receives 2.5w.
    class Net(kg.KeepGradModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.losses_seen = []

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable):
                y_pred, _ = self.stateless_call(trainable, non_trainable, x)
                return 0.5 * jnp.mean((y_pred - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(trainable)
            self.losses_seen.append(float(np.asarray(loss)))
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    inputs = keras.Input((1,))
    model = Net(inputs, dense_0()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **EAGER_MODES[mode])
    rec = fit_batches(model, 2)
    # 0.5 * mean((w*x)^2) = 1.25 w^2 at w = 3, then at w = 3 - 0.1 * 7.5 = 2.25.
    assert model.losses_seen == [11.25, 6.328125]
    assert rec.seen == [7.5, 5.625]


@pytest.mark.parametrize("mode", list(EAGER_MODES))
def test_an_eager_step_keeps_every_other_and_saves(mode, tmp_path):
    model, layer, rec = _fit_host_side(
        kg.KeepGradModel, EAGER_MODES[mode], keep_every=2, save_gradients=True
    )
    # Only the first of the two steps writes the slots.
    assert layer.calls == KERAS_CALLS and rec.seen == [15.0, 15.0]
    path = str(tmp_path / "kept.weights.h5")
    model.save_weights(path)
    fresh, _ = _host_side_model(save_gradients=True)
    fresh.load_weights(path)
    assert float(kernel(fresh)[0, 0]) == 15.0


@pytest.mark.parametrize("mode", list(EAGER_MODES))
def test_an_eager_step_under_loss_scaling_keeps_float32(mode):
    keras.config.set_dtype_policy("mixed_float16")
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **EAGER_MODES[mode])
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rec = fit_batches(model, 4)
    # As under jit (test_model.py): three overflowing steps skipped, then 5w
    # unscaled; the slots take the dtype the first step's optimizer received.
    assert [np.isfinite(g) for g in rec.seen] == [False, False, False, True]
    assert rec.seen[3] == 15.0
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


def test_steps_per_execution_keeps_the_last_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    rec = fit_batches(model, 4)
    # Called back after steps 2 and 4: 5w at w = 1.5 and at w = 0.375.
    assert rec.seen == [7.5, 1.875]


def test_slots_are_donated_to_the_next_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(X, Y)
    first = kernel(model)
    copied = np.array(first)  # a copy (`np.asarray` may be a view)
    model.train_on_batch(X, Y)
    # The next step wrote its gradients into the same buffer: a reference
    # from before it is gone; the copy stays.
    assert first.is_deleted()
    assert copied[0, 0] == 15.0 and float(kernel(model)[0, 0]) == 7.5


def test_a_numpy_view_keeps_its_buffer():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(X, Y)
    view = np.asarray(kernel(model))
    model.train_on_batch(X, Y)
    # JAX does not donate a buffer that a NumPy array still reads.
    assert view[0, 0] == 15.0 and float(kernel(model)[0, 0]) == 7.5


def test_no_tensorflow_in_the_step():
    # The keeping machinery on JAX never touches TensorFlow: a step whose
    # trace reached it would fail on JAX tracers.
    model = one_weight()
    fit_once(model, metrics=[kg.metrics.GradientNorm(), kg.metrics.UpdateRatio(per_layer=True)])
    assert float(kernel(model)[0, 0]) == 15.0
    from keras_keepgrad.backend import jax as _keeper_jax

    assert "tensorflow" not in _keeper_jax.__dict__


# Distribution -----------------------------------------------------------


needs_two_devices = pytest.mark.skipif(
    len(jax.devices("cpu")) < 2,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2",
)


def _two_weights_model(layout_map=None):
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(
        2,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0]]),
        name="dense_0",
    )(inputs)
    return kg.KeepGradModel(inputs, outputs)


X2 = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]], dtype="float32")
Y2 = np.zeros((4, 2), dtype="float32")


def _one_device_gradient():
    model = _two_weights_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X2, Y2, batch_size=4, shuffle=False, verbose=0)
    return np.asarray(model.gradients["dense_0"]["kernel"])


def test_two_devices_are_there():
    # The subprocess of `tests/test_backends.py` sets the XLA flag; here it
    # is checked rather than silently skipping the distribution tests.
    if "xla_force_host_platform_device_count=2" in os.environ.get("XLA_FLAGS", ""):
        assert len(jax.devices("cpu")) == 2


@needs_two_devices
def test_data_parallel_keeps_the_global_batch_gradient():
    expected = _one_device_gradient()
    # d/dW mean((xW)^2) over the 4 rows and 2 outputs: X2^T (X2 W) / 4.
    w = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert np.allclose(expected, X2.T @ (X2 @ w) / 4.0, atol=1e-6)
    distribution = keras.distribution.DataParallel(devices=jax.devices("cpu")[:2])
    with distribution.scope():
        model = _two_weights_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X2, Y2, batch_size=4, shuffle=False, verbose=0)
        grad = model.gradients["dense_0"]["kernel"]
    assert len(grad.sharding.device_set) == 2
    assert grad.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


@needs_two_devices
def test_model_parallel_slots_take_the_variables_layout():
    expected = _one_device_gradient()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], jax.devices("cpu")[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_0/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = _two_weights_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X2, Y2, batch_size=4, shuffle=False, verbose=0)
        grad = model.gradients["dense_0"]["kernel"]
        variable = model.trainable_variables[0]
        assert grad.sharding.is_equivalent_to(variable.value.sharding, 2)
    assert not grad.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


def _fit_dynamics(x):
    from keras_keepgrad import metrics as kgm

    metrics = [
        kgm.GradientNoiseScale(accumulation_steps=2, smoothing=0.0, components=True),
        kgm.GradientSNR(accumulation_steps=2),
        kgm.GradientCosine(),
    ]
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=metrics)
    x = np.asarray(x, "float32").reshape(-1, 1)
    history = model.fit(x, np.zeros_like(x), batch_size=2, shuffle=False, verbose=0).history
    return metrics, history


@needs_two_devices
def test_data_parallel_dynamics_use_the_window_of_steps():
    # The one-weight model (w = 3, gradient 2 w x^2 per example), global
    # batches of 2: step 1 x = (1, 1), g = 6; step 2 x = (2, 2), g = 24; each
    # device gets one example of each. Over the window of k = 2 steps of
    # b = 2: S = (36 + 576) / 2 = 306, Q = 15^2 = 225, B_small = 2,
    # B_big = 4: |G|^2 ~ (4 Q - 2 S) / (4 - 2) = 144, tr(Sigma) ~
    # (S - Q) / (1/2 - 1/4) = 324, B_simple = 2.25; SNR 15 / sqrt(162). The
    # devices' halves as small batches would agree within each step
    # (tr(Sigma) ~ 0), as one device does not see them.
    _, alone = _fit_dynamics([1, 1, 2, 2])
    distribution = keras.distribution.DataParallel(devices=jax.devices("cpu")[:2])
    with distribution.scope():
        metrics, history = _fit_dynamics([1, 1, 2, 2])
    assert history == alone
    assert history["grad_noise_scale/grad_sq"] == [144.0]
    assert history["grad_noise_scale/trace_cov"] == [324.0]
    assert history["grad_noise_scale"] == [2.25]
    assert history["grad_snr/dense_0"] == [pytest.approx(5 / (3 * np.sqrt(2)), rel=1e-6)]
    assert history["grad_cosine"] == [1.0]
    # The window's buffer is the variable's size, on both devices.
    (buffer,) = metrics[0]._holder.variables["buffers"].values()
    assert buffer.shape == (1, 1)
    assert len(buffer.value.sharding.device_set) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_benchmark_smoke_and_the_xla_cost_of_keeping(tmp_path):
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "run.py")
    spec = importlib.util.spec_from_file_location("bench_run", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["keeping", "--smoke", "--backend", "jax", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["backend"] == "jax" and "jax" in written["versions"]
    configs = written["configs"]
    assert [c["model"] for c in configs] == ["mlp_1m", "conv"]
    for c in configs:
        assert c["rounds"] == 2 and list(c["step_ms"]) == ["plain", "control", "kept"]
        # XLA's cost model of the compiled steps: keeping adds no
        # arithmetic, and moves at most one parameter-sized write more.
        assert c["xla"]["kept"]["flops"] == c["xla"]["plain"]["flops"]
        assert 0.0 <= c["xla"]["extra_bytes_in_parameter_writes"] <= 1.0
