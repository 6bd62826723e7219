"""KeepGradModel on Keras's JAX backend (run with KERAS_BACKEND=jax).

`tests/test_backends.py` runs this directory in a subprocess with
`KERAS_BACKEND=jax` and two host CPU devices; the TensorFlow run of the
suite does not collect it.

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
from conftest import kernel
from conftest import one_weight

import keras_keepgrad as kg

assert keras.backend.backend() == "jax", "run this directory with KERAS_BACKEND=jax"


def fit_once(model, optimizer=None, batches=1, **compile_kwargs):
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model.fit(
        np.tile(X, (batches, 1)),
        np.tile(Y, (batches, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
    )


def fit_batches(model, batches, callback):
    model.fit(
        np.tile(X, (batches, 1)),
        np.tile(Y, (batches, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    )


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
    rec = Recorder()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    fit_batches(model, 3, rec)
    assert rec.seen == [15.0, 7.5, 3.75]
    assert rec.seen == [reference_grad(w) for w in (3.0, 1.5, 0.75)]


def test_subclassed_and_wrapped_models():
    class Net(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(
                1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0)
            )

        def call(self, x):
            return self.dense(x)

    net = Net(name="net")
    fit_once(net)
    assert float(net.gradients["net"]["dense"]["kernel"][0, 0]) == 15.0

    plain = keras.Sequential([keras.Input((1,)), one_weight(cls=keras.Model).layers[-1]])
    kept = kg.keep_gradients(plain)
    fit_once(kept)
    assert float(kept.get_gradients_by_path()["dense_0/kernel"][0, 0]) == 15.0
    assert float(plain.get_weights()[0][0, 0]) == 1.5


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


def test_gradient_metrics(mode):
    model = one_weight()
    metrics = [
        kg.metrics.GradientNorm(),
        kg.metrics.GradientMaxAbs(),
        kg.metrics.NonFiniteGradients(),
        kg.metrics.UpdateRatio(),
        kg.metrics.VanishingGradients(threshold=20.0),
        kg.metrics.GradientMetric(lambda g: g["dense_0"]["kernel"][0, 0] * 2.0, name="twice"),
    ]
    history = fit_once(model, metrics=metrics, **mode)
    assert history.history["grad_norm"] == [15.0]
    assert history.history["grad_max_abs"] == [15.0]
    assert history.history["grad_nonfinite"] == [0.0]
    assert history.history["update_ratio"] == [0.5]  # |1.5 - 3| / 3
    assert history.history["grad_vanishing"] == [1.0]  # 15 < 20
    assert history.history["twice"] == [30.0]


def test_gradient_metrics_over_two_steps_and_evaluation():
    model = one_weight()
    history = fit_once(model, batches=2, metrics=[kg.metrics.GradientNorm(reduction="last")])
    assert history.history["grad_norm"] == [7.5]
    assert "grad_norm" not in model.evaluate(X, Y, verbose=0, return_dict=True)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_is_unscaled(policy):
    keras.config.set_dtype_policy(policy)
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if policy == "mixed_float16":
        # Keras wraps the optimizer itself under mixed_float16.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rec = Recorder()
    fit_batches(model, 4, rec)
    # As on TensorFlow: 3, 6, 1.5, 3 and their squares are exact in float16
    # and bfloat16.
    if policy == "mixed_bfloat16":
        assert rec.seen == [15.0, 7.5, 3.75, 1.875]
    else:
        # The default scale 2**15 overflows the float16 activations'
        # gradients (6 * scale > 65504) until it has halved to 4096: three
        # skipped steps that keep their non-finite gradients, then 5w,
        # unscaled.
        assert [np.isfinite(g) for g in rec.seen] == [False, False, False, True]
        assert rec.seen[3] == 15.0
        assert float(model.optimizer.dynamic_scale.value) == 4096.0
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


def test_static_loss_scale_factor_is_divided_out():
    model = one_weight()
    fit_once(model, optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=8.0))
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 1.5


def test_keep_every_writes_steps_1_3_5_and_holds_between(mode):
    model = one_weight(keep_every=2)
    rec = Recorder()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    fit_batches(model, 5, rec)
    assert rec.seen == [15.0, 15.0, 3.75, 3.75, 0.9375]


def test_steps_per_execution_keeps_the_last_step():
    model = one_weight()
    rec = Recorder()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    fit_batches(model, 4, rec)
    # Called back after steps 2 and 4: 5w at w = 1.5 and at w = 0.375.
    assert rec.seen == [7.5, 1.875]


def test_train_on_batch_and_nothing_before_the_first_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(RuntimeError, match="no kept gradients yet"):
        model.gradients
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 7.5


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


def test_kept_gradients_are_not_weights_and_save_only_when_asked(tmp_path):
    model = one_weight()
    fit_once(model)
    assert len(model.weights) == 1
    path = str(tmp_path / "plain.weights.h5")
    model.save_weights(path)
    fresh = one_weight()
    fresh.load_weights(path)
    assert float(fresh.get_weights()[0][0, 0]) == 1.5

    saving = one_weight(save_gradients=True)
    fit_once(saving)
    path = str(tmp_path / "kept.keras")
    saving.save(path)
    restored = keras.saving.load_model(path)
    assert float(restored.gradients["dense_0"]["kernel"][0, 0]) == 15.0


def test_keep_gradients_off_is_plain_keras_and_can_be_turned_on():
    model = one_weight(keep_gradients=False)
    fit_once(model)
    assert float(model.get_weights()[0][0, 0]) == 1.5
    with pytest.raises(AttributeError, match="keep_gradients=True"):
        model.gradients
    model.keep_gradients = True
    model.fit(X, Y, batch_size=2, verbose=0)
    assert float(kernel(model)[0, 0]) == 7.5  # 5w at w = 1.5


def test_evaluate_and_predict_leave_the_kept_gradients():
    model = one_weight()
    fit_once(model)
    assert model.evaluate(X, Y, verbose=0) == pytest.approx(5.625)  # mean(1.5^2, 3^2)
    assert model.predict(X, verbose=0).tolist() == [[1.5], [3.0]]
    assert float(kernel(model)[0, 0]) == 15.0


def test_loading_mismatched_saved_gradients_raises_first(tmp_path):
    saving = one_weight(save_gradients=True)
    fit_once(saving)
    path = str(tmp_path / "kept.weights.h5")
    saving.save_weights(path)
    other = one_weight(layer="dense_0", keep_every=1)
    inputs = keras.Input((2,))
    wider = kg.KeepGradModel(inputs, keras.layers.Dense(1, use_bias=False, name="dense_0")(inputs))
    with pytest.raises(ValueError, match="has shape"):
        wider.load_weights(path)
    other.load_weights(path)
    assert float(other.gradients["dense_0"]["kernel"][0, 0]) == 15.0


def test_no_tensorflow_in_the_step():
    # The keeping machinery on JAX never touches TensorFlow: a step whose
    # trace reached it would fail on JAX tracers.
    model = one_weight()
    fit_once(model, metrics=[kg.metrics.GradientNorm(), kg.metrics.UpdateRatio(per_layer=True)])
    assert float(kernel(model)[0, 0]) == 15.0
    from keras_keepgrad import _keeper_jax

    assert "tensorflow" not in _keeper_jax.__dict__


def test_other_backends_named_in_the_error(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    match = r"requires the TensorFlow, the JAX or the PyTorch backend.*KERAS_BACKEND='numpy'"
    with pytest.raises(RuntimeError, match=match):
        one_weight()


# Callbacks (they write through TensorFlow's `tf.summary`, as Keras's own
# TensorBoard callback does on every backend) -------------------------------


def test_callbacks_read_every_step(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    monitor = kg.callbacks.GradientMonitor(check_freq=1)
    callbacks = [
        kg.callbacks.GradientTensorBoard(str(tmp_path / "tb"), update_freq=1),
        monitor,
        kg.callbacks.GradientSnapshot(str(tmp_path / "snap" / "{step:03d}.npz"), every=1),
    ]
    model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    snaps = [np.load(tmp_path / "snap" / f"{step:03d}.npz") for step in (1, 2, 3)]
    assert [float(s["dense_0/kernel"][0, 0]) for s in snaps] == [15.0, 7.5, 3.75]
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb" / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    norms = [
        float(tensor_util.make_ndarray(e.tensor_proto))
        for e in acc.Tensors("gradients/global_norm")
    ]
    assert norms == [15.0, 7.5, 3.75]
    assert monitor.events == []  # nothing non-finite, vanishing or exploding


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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_benchmark_smoke_and_the_xla_cost_of_keeping(tmp_path):
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "overhead_jax.py")
    spec = importlib.util.spec_from_file_location("overhead_jax", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["model"] for r in results] == ["mlp_1m", "conv"]
    for r in results:
        assert r["rounds"] == 2 and len(r["ratios"]["kept"]) == 2
        # XLA's cost model of the compiled steps: keeping adds no
        # arithmetic, and moves at most one parameter-sized write more.
        assert r["xla_flops"]["kept"] == r["xla_flops"]["plain"]
        assert 0.0 <= r["extra_bytes_in_parameter_writes"] <= 1.0


@pytest.mark.parametrize("name", ["GradientNoiseScale", "GradientSNR", "GradientCosine"])
def test_training_dynamics_metrics_raise_naming_tensorflow(name):
    with pytest.raises(NotImplementedError, match="runs on the TensorFlow backend only"):
        getattr(kg.metrics, name)()
