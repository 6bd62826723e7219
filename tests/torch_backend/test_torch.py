"""KeepGradModel on Keras's PyTorch backend (run with KERAS_BACKEND=torch).

`tests/test_backends.py` runs this directory, with the contract's test
modules (`conftest.CONTRACT`, the same on every backend), in a subprocess
with `KERAS_BACKEND=torch`; the TensorFlow run of the suite does not collect
it. Here: what is PyTorch's own (`torch.autograd.grad` references, a
`train_step` in PyTorch style, the held `.grad` tensors, `torch.compile`).

The hand model: one bias-free Dense(1) with w = 3, x = [[1], [2]], y = 0,
mse. loss = mean((w*x)^2), so d/dw = 5w = 15; with SGD(0.1) w' = 1.5, then
5w' = 7.5, then 3.75.
"""

import warnings

import keras
import numpy as np
import pytest
import torch
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

assert keras.backend.backend() == "torch", "run this directory with KERAS_BACKEND=torch"


def user_warnings(fn, *args, **kwargs):
    """The UserWarnings `fn(*args, **kwargs)` warns, as strings.

    Not `pytest.warns`, which re-raises every other warning with its origin
    lost, here Keras's own DeprecationWarning (ignored in `pyproject.toml`)
    as it turns a step's torch tensors into the logs' NumPy values.
    """
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    return [str(w.message) for w in seen if w.category is UserWarning]


# Where the behaviour must not change: eager, and compiled with `torch.compile`.
JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit"])
# The keeping and the update it wraps (`apply`) run eagerly under
# `torch.compile` (`_capture._outside_torch_compile`): a compiled case of
# these crosses the graph breaks that the compiled case of
# test_an_update_that_writes_its_gradients_is_kept_as_it_received_them does.
EAGER_UNDER_COMPILE = pytest.mark.not_compiled_on_torch(
    reason="test_an_update_that_writes_its_gradients_is_kept_as_it_received_them"
)


def reference_grad(w):
    """`torch.autograd.grad` of the same loss, mean((w*x)^2), at `w`."""
    w = torch.tensor(w, dtype=torch.float32, requires_grad=True)
    loss = torch.mean((w * torch.from_numpy(X)) ** 2)
    (grad,) = torch.autograd.grad(loss, w)
    return float(grad)


def test_reference_is_5w():
    assert reference_grad(W0) == 15.0


def test_functional_model_keeps_the_exact_gradient(mode):
    model = one_weight()
    history = fit_once(model, **mode)
    grad = kernel(model)
    assert isinstance(grad, torch.Tensor) and not grad.requires_grad
    assert float(grad[0, 0]) == reference_grad(W0) == 15.0
    w_after = float(model.get_weights()[0][0, 0])
    assert w_after == 1.5
    assert (W0 - w_after) / 0.1 == 15.0  # (w - w') / lr with SGD
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}
    assert list(model.get_gradients_by_path()) == ["dense_0/kernel"]
    assert history.history["loss"] == [22.5]  # mean(9, 36)


@EAGER_UNDER_COMPILE
def test_three_steps_follow_the_weight(mode):
    model = one_weight()
    rec = Recorder()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    fit_batches(model, 3, callbacks=[rec])
    assert rec.seen == [15.0, 7.5, 3.75]
    assert rec.seen == [reference_grad(w) for w in (3.0, 1.5, 0.75)]


class _TorchStyleNet(kg.KeepGradModel):
    """A `train_step` of the user's own, as PyTorch users write it."""

    def __init__(self, factor=1.0, zero_grad_in_place=False, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense_0()
        self.factor = factor
        self.zero_grad_in_place = zero_grad_in_place

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        # `set_to_none=False` zeroes the existing `.grad` tensors in place.
        self.zero_grad(set_to_none=not self.zero_grad_in_place)
        loss = self.factor * torch.mean((self(x) - torch.as_tensor(y)) ** 2)
        loss.backward()
        grads = [v.value.grad for v in self.trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_weights)
        return {"loss": loss.detach()}


@JIT
def test_own_torch_style_train_step_is_kept(jit_compile):
    # Half the loss: the optimizer receives 7.5, which is kept.
    net = _TorchStyleNet(factor=0.5, name="net")
    fit_once(net, jit_compile=jit_compile)
    assert float(net.gradients["net"]["dense_0"]["kernel"][0, 0]) == 7.5
    assert float(net.get_weights()[0][0, 0]) == 2.25  # 3 - 0.1 * 7.5


@JIT
def test_two_optimizers_in_own_train_step_are_both_kept(jit_compile):
    # A GAN-like step: each of two one-weight layers has its own optimizer.
    # y = w1 * w0 * x with w0 = 3, w1 = 1: d/dw0 = 5 * w0 * w1^2 = 15,
    # d/dw1 = 5 * w1 * w0^2 = 45.
    class Net(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = dense_0(name="first")
            self.second = dense_0(name="second", w=1.0)
            self.opt_a = keras.optimizers.SGD(0.01)
            self.opt_b = keras.optimizers.Adam(0.01)

        def call(self, x):
            return self.second(self.first(x))

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            loss = torch.mean((self(x) - y) ** 2)
            loss.backward()
            w0, w1 = self.first.kernel, self.second.kernel
            with torch.no_grad():
                self.opt_a.apply([w0.value.grad], [w0])
                self.opt_b.apply_gradients([(w1.value.grad, w1)])
            return {"loss": loss.detach()}

    net = Net(name="gan")
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    net.fit(X, Y, batch_size=2, verbose=0)
    assert float(net.gradients["gan"]["first"]["kernel"][0, 0]) == 15.0
    assert float(net.gradients["gan"]["second"]["kernel"][0, 0]) == 45.0
    assert float(net.first.kernel.numpy()[0, 0]) == pytest.approx(3.0 - 0.01 * 15.0)


def test_paths_that_collide_across_two_optimizers_raise_before_anything_changes():
    # The second sub-model is not an attribute, so not the model's: its
    # paths, "out/kernel" and "out/bias" as the first's, meet them only at
    # its optimizer. The step runs eagerly: the first optimizer has applied
    # by then, and its update is put back before the second raises.
    def out_model(w):
        inputs = keras.Input((1,))
        out = keras.layers.Dense(1, name="out", kernel_initializer=keras.initializers.Constant(w))
        return keras.Model(inputs, out(inputs))

    second = out_model(1.0)
    opt_b = keras.optimizers.SGD(0.1)

    class Untracked(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = out_model(3.0)

        def call(self, x):
            return second(self.first(x))

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            second.zero_grad()
            loss = torch.mean((self(x) - y) ** 2)
            loss.backward()
            variables = self.first.trainable_variables + second.trainable_variables
            grads = [v.value.grad for v in variables]
            with torch.no_grad():
                self.optimizer.apply(grads[:2], variables[:2])
                opt_b.apply(grads[2:], variables[2:])
            return {"loss": loss.detach()}

    model = Untracked()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    with pytest.raises(ValueError, match="share the paths 'out/bias', 'out/kernel': one"):
        model.fit(X, Y, batch_size=2, verbose=0)
    # Before the put-back, SGD(0.5) had made them -4.5 and -4.5 (gradients
    # 15 and 9 of y = w1 (w0 x + b0) + b1 = 3x) and its iterations 1.
    assert [w.tolist() for w in model.get_weights()] == [[[3.0]], [0.0]]
    assert int(model.optimizer.iterations) == 0
    assert [w.tolist() for w in second.get_weights()] == [[[1.0]], [0.0]]
    assert int(opt_b.iterations) == 0


@JIT
def test_keep_step_gradients_without_optimizer(jit_compile):
    class Net(kg.KeepGradModel):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            loss = torch.mean((self(x) - y) ** 2)
            loss.backward()
            variables = self.trainable_variables
            grads = self.keep_step_gradients([v.value.grad for v in variables], variables)
            with torch.no_grad():
                for v, g in zip(variables, grads):
                    v.assign(v.value - 0.1 * g)
            return {"loss": loss.detach(), **self.compute_metrics(x, y, y)}

    inputs = keras.Input((1,))
    model = Net(inputs, dense_0()(inputs))
    metrics = [kg.metrics.GradientNorm(), kg.metrics.UpdateRatio()]
    history = fit_once(model, metrics=metrics, jit_compile=jit_compile).history
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 1.5
    assert history["grad_norm"] == [15.0]
    # `UpdateRatio` sees optimizer updates only: no value, NaN, not 0.
    assert np.isnan(history["update_ratio"][0])


@JIT
def test_loss_scale_optimizer_keeps_the_unscaled_gradient_once(monkeypatch, jit_compile):
    # Scale 8: the optimizer receives 8 * 15 = 120; its inner SGD receives
    # 15 (its `apply` is not kept a second time, scaled or not).
    from keras_keepgrad.backend import torch as _keeper_torch

    calls = []
    keep = _keeper_torch.GradientKeeper.keep_from_optimizer

    def counting(self, step, optimizer, *args):
        calls.append(type(optimizer).__name__)
        return keep(self, step, optimizer, *args)

    monkeypatch.setattr(_keeper_torch.GradientKeeper, "keep_from_optimizer", counting)
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=8.0, dynamic_growth_steps=1000
    )
    model = one_weight()
    rec = Recorder()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    fit_batches(model, 2, callbacks=[rec])
    assert calls == ["LossScaleOptimizer", "LossScaleOptimizer"]  # one per step
    assert rec.seen == [15.0, 7.5]
    assert float(model.get_weights()[0][0, 0]) == 0.75
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


@JIT
def test_float16_variables_keep_the_dtype_their_update_receives(jit_compile):
    # A float16 layer under a LossScaleOptimizer. On PyTorch, Keras's
    # unscaling `ops.divide(grad, scale)` of a float16 gradient by the
    # float32 0-d scale is float16 (torch's promotion; float32 on
    # TensorFlow and JAX): the inner optimizer receives float16, and that
    # is what is kept.
    model = one_weight(dtype="float16")
    inner = keras.optimizers.SGD(0.1)
    optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    received = []
    inner_apply = inner.apply

    def spy(grads, trainable_variables=None):
        received.extend(grads)
        return inner_apply(grads, trainable_variables)

    inner.apply = spy
    fit_once(model, optimizer=optimizer, jit_compile=jit_compile)
    (grad,) = received
    assert grad.dtype == torch.float16 and float(grad[0, 0]) == 15.0
    assert model.gradient_dtypes == {"dense_0/kernel": "float16"}
    assert kernel(model).dtype == torch.float16
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 1.5


@EAGER_UNDER_COMPILE
@JIT
def test_adam_clipping_and_weight_decay_leave_the_held_gradient_as_received(jit_compile):
    # Adam's `torch._foreach_*_` updates, `clipnorm` and AdamW's decay read
    # the gradient and write other tensors: the held `.grad` stays 5w,
    # unclipped. Adam's first step moves w by lr: 3 -> 2.9 (decay first:
    # 3 * (1 - 0.01 * 0.1) = 2.997, then 2.897).
    for optimizer, w1 in [
        (keras.optimizers.Adam(0.1, clipnorm=1.0), 2.9),
        (keras.optimizers.AdamW(0.1, weight_decay=0.01, clipvalue=1.0), 2.897),
    ]:
        model = one_weight()
        rec = Recorder()
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
        fit_batches(model, 2, callbacks=[rec])
        assert rec.seen[0] == 15.0
        assert rec.seen[1] == pytest.approx(5.0 * w1, rel=1e-5)  # 5w at w1


def test_steps_per_execution_is_refused_by_keras_on_torch():
    # Keras 3.15's PyTorch trainer runs one step per execution and says so;
    # KeepGradModel leaves that error as it is.
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="`steps_per_execution` must be 1 with the PyTorch"):
        model.fit(np.tile(X, (4, 1)), np.tile(Y, (4, 1)), batch_size=2, verbose=0)


# `torch.compile` (jit_compile=True): the step compiled, the keeping eager -----


def test_jit_compile_compiles_the_step_and_keeps_outside_it(monkeypatch):
    from torch._dynamo.utils import counters

    from keras_keepgrad.backend import torch as _keeper_torch

    compiling = []
    keep = _keeper_torch.GradientKeeper.keep_from_optimizer

    def spy(self, *args):
        compiling.append(torch.compiler.is_compiling())
        return keep(self, *args)

    monkeypatch.setattr(_keeper_torch.GradientKeeper, "keep_from_optimizer", spy)
    counters.clear()
    model = one_weight()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        jit_compile=True,
        metrics=[kg.metrics.GradientNorm(reduction="last")],
    )
    assert model.jit_compile is True
    rec = Recorder()
    history = model.fit(
        np.tile(X, (2, 1)),
        np.tile(Y, (2, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[rec],
    )
    assert rec.seen == [15.0, 7.5]
    assert history.history["grad_norm"] == [7.5]
    assert float(model.get_weights()[0][0, 0]) == 0.75
    # The step was compiled, and the keeping ran outside it, on each step.
    assert counters["stats"]["unique_graphs"] > 0
    assert compiling == [False, False]
    # Compiled too, evaluation leaves the gradient metrics out.
    assert "grad_norm" not in model.evaluate(X, Y, verbose=0, return_dict=True)


def test_a_jit_compile_test_fails_where_dynamo_would_stop_compiling(monkeypatch):
    # Dynamo compiles a model's step twice (its first step, before the
    # gradients exist, and the next), as for a plain model, and stops at
    # `recompile_limit` (8) versions of Keras's step: a fifth model fitted
    # for two steps would run its step eagerly. The tests' Dynamo
    # (conftest) fails there instead, so a "jit" test never passes on the
    # eager step. Shown here with a limit of 2 (one model's two versions),
    # as each model costs a compilation.
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch._dynamo.utils import counters

    assert torch._dynamo.config.recompile_limit == 8
    assert torch._dynamo.config.fail_on_recompile_limit_hit is True
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    counters.clear()
    fit_once(one_weight(), batches=2, jit_compile=True)
    assert counters["stats"]["unique_graphs"] > 0
    with pytest.raises(FailOnRecompileLimitHit):
        fit_once(one_weight(), batches=2, jit_compile=True)


def test_jit_compile_set_afterwards_and_keeping_turned_on_under_it():
    model = one_weight(keep_gradients=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    model.keep_gradients = True
    assert (model.keep_gradients, model.jit_compile) == (True, True)
    model.jit_compile = False
    model.jit_compile = True
    assert model.jit_compile is True
    rec = fit_batches(model, 2)
    assert rec.seen == [15.0, 7.5]


def test_a_restored_or_wrapped_jit_compile_is_kept(tmp_path):
    # A compile config with `jit_compile=True` (a file saved on any
    # backend) compiles the step with `torch.compile`.
    plain = one_weight(keep_gradients=False)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    config = plain.get_compile_config()
    assert config["jit_compile"] is True
    model = one_weight()
    model.compile_from_config(config)
    assert model.compiled and model.jit_compile is True
    rec = fit_batches(model, 2)
    assert rec.seen == [15.0, 7.5]
    # `keep_gradients()` of a plain model compiled so: the same.
    plain = one_weight(cls=keras.Model, name="plain")
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    wrapped = kg.keep_gradients(plain)
    assert wrapped.compiled and wrapped.jit_compile is True
    # `load_model` compiles a saved KeepGradModel, with its optimizer's state.
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.compiled and loaded.jit_compile is True
    assert int(loaded.optimizer.iterations) == 2


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_is_unscaled_under_jit_compile(policy):
    # As `test_mixed_precision_is_unscaled` (any backend), compiled. The
    # compiled float16 step computes its activations' gradients in float32
    # (inductor upcasts), so the default scale need not overflow as it does
    # eagerly: whatever the step computed, the kept value is what the update
    # received, 5w unscaled, and SGD moved w by 0.1 of it (a skipped step:
    # not at all).
    keras.config.set_dtype_policy(policy)
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    weights = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: weights.append(float(model.get_weights()[0][0, 0]))
    )
    rec = fit_batches(model, 4, callbacks=[callback])
    before = [W0, *weights[:-1]]
    for grad, w, w_after in zip(rec.seen, before, weights):
        if np.isfinite(grad):
            assert grad == 5.0 * w and w_after == w - 0.1 * grad
        else:
            assert policy == "mixed_float16" and w_after == w
    if policy == "mixed_bfloat16":
        assert rec.seen == [15.0, 7.5, 3.75, 1.875]
    assert np.isfinite(rec.seen[-1])
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


class _HandUpdate(kg.KeepGradModel):
    """Updates by hand; `keep=True` passes the gradients through
    `keep_step_gradients`, `head_only=True` applies only the head's."""

    def __init__(self, *args, keep=True, head_only=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep = keep
        self.head_only = head_only

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        self.zero_grad()
        loss = torch.mean((self(x) - torch.as_tensor(y)) ** 2)
        loss.backward()
        variables = self.trainable_variables
        if self.head_only:
            head = [v for v in variables if "head" in v.path]
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in head], head)
            return {"loss": loss.detach()}
        grads = [v.value.grad for v in variables]
        if self.keep:
            grads = self.keep_step_gradients(grads, variables)
        with torch.no_grad():
            for v, g in zip(variables, grads):
                v.assign(v.value - 0.1 * g)
        return {"loss": loss.detach()}


def test_a_step_that_keeps_nothing_says_so_everywhere(tmp_path):
    inputs = keras.Input((1,))
    model = _HandUpdate(inputs, dense_0()(inputs), keep=False)
    model.compile(loss="mse")
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "s{step}.npz"), every=1)
    seen = user_warnings(
        model.fit,
        np.tile(X, (2, 1)),
        np.tile(Y, (2, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[snapshot],
    )
    assert len(seen) == 1 and "passed no gradients to an optimizer" in seen[0]  # once
    assert list(tmp_path.iterdir()) == []  # no file of placeholders
    with pytest.raises(RuntimeError, match="keep_step_gradients"):
        model.gradients
    # The update itself ran, as in a plain model: 3 - 0.1 * 15 - 0.1 * 7.5.
    assert float(model.get_weights()[0][0, 0]) == 0.75


def test_a_gradient_metric_in_a_step_that_keeps_nothing_raises():
    class Updating(_HandUpdate):
        def train_step(self, data):
            logs = super().train_step(data)
            self.compute_metrics(data[0], data[1], self(data[0]))
            return logs

    inputs = keras.Input((1,))
    model = Updating(inputs, dense_0()(inputs), keep=False)
    model.compile(loss="mse", metrics=[kg.metrics.GradientNorm()])
    with pytest.raises(ValueError, match="after `optimizer.apply"):
        model.fit(X, Y, batch_size=2, verbose=0)


def test_variables_no_optimizer_receives_are_absent_with_a_warning():
    inputs = keras.Input((1,))
    hidden = dense_0(name="body", w=1.0)(inputs)
    model = _HandUpdate(inputs, dense_0(name="head")(hidden), head_only=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    (seen,) = user_warnings(model.fit, X, Y, batch_size=2, verbose=0)
    assert "['body/kernel'] to any optimizer" in seen and "`optimizer.apply`" in seen
    # d/dh mean((h b x)^2) = 2 h b^2 mean(x^2) = 2 * 3 * 2.5 = 15; no body entry.
    assert list(model.get_gradients_by_path()) == ["head/kernel"]
    assert float(model.gradients["head"]["kernel"][0, 0]) == 15.0


def test_keep_step_gradients_outside_a_training_step_raises():
    model = one_weight()
    with pytest.raises(RuntimeError, match="call it from its `train_step`"):
        model.keep_step_gradients([torch.ones((1, 1))], model.trainable_variables)


# What is held: a copy of what `apply` received ---------------------------


def test_the_kept_gradient_is_a_copy_of_grad_and_survives_the_next_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(X, Y)
    first = kernel(model)
    grad = model.trainable_variables[0].value.grad
    # Equal to the parameter's `.grad`, in a buffer of its own.
    assert float(first[0, 0]) == float(grad[0, 0]) == 15.0
    assert first.data_ptr() != grad.data_ptr()
    model.train_on_batch(X, Y)
    assert float(first[0, 0]) == 15.0 and float(kernel(model)[0, 0]) == 7.5


@JIT
def test_a_gradient_written_in_place_after_apply_is_kept_as_apply_received_it(jit_compile):
    class Net(_TorchStyleNet):
        def train_step(self, data):
            logs = super().train_step(data)
            self.zero_grad(set_to_none=False)  # zeroes what apply received
            return logs

    net = Net(name="net")
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    net.train_on_batch(X, Y)
    assert float(net.trainable_variables[0].value.grad[0, 0]) == 0.0
    assert float(net.gradients["net"]["dense_0"]["kernel"][0, 0]) == 15.0


def test_a_gradient_written_in_place_between_steps_leaves_the_kept_one():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(X, Y)
    model.trainable_variables[0].value.grad.mul_(2.0)
    assert float(kernel(model)[0, 0]) == 15.0


def test_an_unscaled_gradient_is_not_copied_twice():
    # Dividing out the loss scale makes a new tensor: it is kept as it is.
    model = one_weight()
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0),
        loss="mse",
    )
    made = []
    original = torch.Tensor.clone

    def counting_clone(self, *args, **kwargs):
        made.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "clone", counting_clone)
        model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    assert made == []


@JIT
def test_zeroing_in_place_before_backward_keeps_every_step(jit_compile):
    # `zero_grad(set_to_none=False)` at the start of each step zeroes the
    # tensors held from the step before; each step keeps its own anyway.
    net = _TorchStyleNet(zero_grad_in_place=True, name="net")
    rec = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: rec.append(
            float(net.gradients["net"]["dense_0"]["kernel"][0, 0])
        )
    )
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    fit_batches(net, 3, callbacks=[callback])
    assert rec == [15.0, 7.5, 3.75]


@JIT
def test_keep_every_holds_its_copy_through_in_place_zeroing(jit_compile):
    # With `keep_every=2` the gradients of steps 1, 3, 5 are held over the
    # next step, whose in-place `zero_grad` zeroes the parameters' `.grad`:
    # the held copies are left alone.
    net = _TorchStyleNet(zero_grad_in_place=True, keep_every=2, name="net")
    rec = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: rec.append(
            float(net.gradients["net"]["dense_0"]["kernel"][0, 0])
        )
    )
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
    fit_batches(net, 5, callbacks=[callback])
    assert rec == [15.0, 15.0, 3.75, 3.75, 0.9375]


def test_no_tensorflow_in_the_keeper():
    from keras_keepgrad import _ops
    from keras_keepgrad import _squares
    from keras_keepgrad.backend import torch as _keeper_torch

    assert "tensorflow" not in _keeper_torch.__dict__
    assert "tensorflow" not in _ops.__dict__
    assert _squares.tf is _ops.tf_ops
    assert "tf" not in _keeper_torch.__dict__


@EAGER_UNDER_COMPILE
@JIT
def test_update_ratio_copies_only_when_asked(jit_compile):
    model = one_weight()
    fit_once(model, jit_compile=jit_compile)
    assert model._keeper.record_updates is False
    model = one_weight()
    history = fit_once(model, metrics=[kg.metrics.UpdateRatio()], jit_compile=jit_compile)
    assert model._keeper.record_updates is True
    assert history.history["update_ratio"] == [0.5]  # |1.5 - 3| / 3


@JIT
def test_per_layer_metrics(jit_compile):
    model = one_weight()
    metrics = [kg.metrics.GradientNorm(per_layer=True), kg.metrics.UpdateRatio(per_layer=True)]
    history = fit_once(model, metrics=metrics, jit_compile=jit_compile)
    assert history.history["grad_norm/dense_0"] == [15.0]
    assert history.history["update_ratio/dense_0"] == [0.5]  # |1.5 - 3| / 3


def test_stateless_apply_in_own_step_is_kept_through_its_apply():
    # On PyTorch `stateless_apply` runs `apply` in a `StatelessScope`.
    class Net(kg.KeepGradModel):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            self.zero_grad()
            loss = torch.mean((self(x) - torch.as_tensor(y)) ** 2)
            loss.backward()
            variables = self.trainable_variables
            with torch.no_grad():
                new, _ = self.optimizer.stateless_apply(
                    [v.value for v in self.optimizer.variables],
                    [v.value.grad for v in variables],
                    [v.value.clone() for v in variables],
                )
            for variable, value in zip(variables, new):
                variable.assign(value)
            return {"loss": loss.detach()}

    inputs = keras.Input((1,))
    model = Net(inputs, dense_0()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.fit(X, Y, batch_size=2, verbose=0)
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 1.5


def test_legacy_h5_save_and_load(tmp_path):
    model = one_weight(keep_every=2)
    fit_once(model)
    path = str(tmp_path / "m.h5")
    model.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    assert type(loaded) is type(model)
    assert loaded.keep_every == 2
    np.testing.assert_array_equal(loaded.get_weights()[0], [[1.5]])


def test_gradient_histograms_are_written(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callback = kg.callbacks.GradientTensorBoard(str(tmp_path), histogram_freq=1)
    fit_batches(model, 2, callbacks=[callback])
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    (event,) = acc.Tensors("dense_0/kernel/gradient")
    # One bucket holding the last step's only entry, 5w at w = 1.5.
    buckets = tensor_util.make_ndarray(event.tensor_proto)
    assert buckets[:, 2].sum() == 1.0
    assert buckets[buckets[:, 2] > 0][0, 0] <= 7.5 <= buckets[buckets[:, 2] > 0][0, 1]


def test_benchmark_smoke_on_pytorch(tmp_path):
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "run.py")
    spec = importlib.util.spec_from_file_location("bench_run", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["keeping", "--smoke", "--backend", "torch", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["versions"]["torch"] == torch.__version__
    configs = written["configs"]
    assert [c["model"] for c in configs] == ["mlp_1m", "conv"]
    for c in configs:
        assert c["rounds"] == 2 and list(c["step_ms"]) == ["plain", "control", "kept", "floor"]
        assert all(ms > 0 for ms in c["step_ms"].values())
        # Kept beside its floor, one copy of every gradient; XLA's cost
        # analysis is JAX's only.
        assert "kept - floor" in c["wall"]["pairs"]
        assert "xla" not in c


class _ZeroingSGD(keras.optimizers.SGD):
    """SGD whose update zeroes the gradients it receives, in place, from
    step `from_step` (counted from 1) on."""

    def __init__(self, from_step=1, **kwargs):
        super().__init__(**kwargs)
        self.from_step = from_step
        self.calls = 0

    def apply(self, grads, trainable_variables=None):
        result = super().apply(grads, trainable_variables)
        self.calls += 1
        if self.calls >= self.from_step:
            for g in grads:
                g.zero_()
        return result


@JIT
def test_an_update_that_writes_its_gradients_is_kept_as_it_received_them(jit_compile):
    # Its first step shows the writes: every step is copied before the update.
    model = one_weight()
    optimizer = _ZeroingSGD(learning_rate=0.1)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    rec = fit_batches(model, 3)
    assert rec.seen == [15.0, 7.5, 3.75]
    assert float(model.trainable_variables[0].value.grad[0, 0]) == 0.0
    assert model._keeper._reads_only[optimizer] is False


@JIT
def test_keras_updates_only_read_their_gradients_so_later_steps_copy_after(jit_compile):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", jit_compile=jit_compile)
    rec = fit_batches(model, 2)
    # Adam's first step moves w by lr * 15 / (15 + 1e-7), to 2.9: the
    # second step's copy, made after its update, still holds 5 * 2.9.
    assert rec.seen == [15.0, pytest.approx(5 * 2.9, rel=1e-6)]
    assert model._keeper._reads_only[model.optimizer] is True


@JIT
def test_an_update_that_starts_writing_its_gradients_raises(jit_compile):
    model = one_weight()
    model.compile(
        optimizer=_ZeroingSGD(from_step=2, learning_rate=0.1), loss="mse", jit_compile=jit_compile
    )
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    with pytest.raises(RuntimeError, match=r"wrote the gradients of \['dense_0/kernel'\] in place"):
        model.train_on_batch(X, Y)
    # From then on it is copied before the update: 5w at w = 1.5 - 0.1 * 7.5.
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 3.75


def test_the_step_statistics_are_the_metrics_own_sums(tmp_path, monkeypatch):
    # PyTorch runs the step eagerly: the keeper's statistics reuse the sums
    # the gradient metric computed (one `dot` per gradient, once per step),
    # and the two callbacks read them without computing anything.
    import stats_cases

    from keras_keepgrad import _squares

    calls = []
    summed = _squares._float32_sums

    def counted(grads):
        calls.append(len(grads))
        return summed(grads)

    monkeypatch.setattr(_squares, "_float32_sums", counted)
    stats_cases.metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch)
    assert calls == [2, 2]  # 2 steps, 2 gradients each


def test_the_step_statistics_without_a_metric_are_computed_once_per_step(monkeypatch):
    import stats_cases

    from keras_keepgrad import _squares

    calls = []
    summed = _squares._float32_sums
    monkeypatch.setattr(_squares, "_float32_sums", lambda g: calls.append(len(g)) or summed(g))
    model = stats_cases.two_layers()
    seen = stats_cases.Squares()
    model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=[kg.callbacks.GradientMonitor(), seen])  # fmt: skip
    assert calls == [2, 2, 2]
    assert [s[2] for s in seen.seen] == [[900.0, 506.25]] * 3


def test_in_place_writes_check_the_shape_and_leave_a_stateless_scope_alone():
    from keras_keepgrad import _compat

    variable = keras.Variable(np.array([1.0, 2.0], "float32"), name="state")
    _compat.torch_assign(variable, np.array([3.0, 4.0], "float32"))
    _compat.torch_assign(variable, torch.tensor([0.5, 0.25]), add=True)
    assert keras.ops.convert_to_numpy(variable).tolist() == [3.5, 4.25]
    scalar = keras.Variable(np.float32(0.0), name="count")
    _compat.torch_assign(scalar, 7.0)
    assert float(keras.ops.convert_to_numpy(scalar)) == 7.0
    # `copy_` would broadcast 1.0 into both entries: refused, as `assign` does.
    with pytest.raises(ValueError, match=r"'state' must have its shape \(2,\)\. .*\(\)"):
        _compat.torch_assign(variable, 1.0)
    assert keras.ops.convert_to_numpy(variable).tolist() == [3.5, 4.25]
    with keras.StatelessScope() as scope:
        _compat.torch_assign(variable, np.array([9.0, 9.0], "float32"))
        _compat.torch_assign(scalar, 1.0, add=True)
    assert keras.ops.convert_to_numpy(variable).tolist() == [3.5, 4.25]
    assert float(keras.ops.convert_to_numpy(scalar)) == 7.0
    assert keras.ops.convert_to_numpy(scope.get_current_value(variable)).tolist() == [9.0, 9.0]
    assert float(keras.ops.convert_to_numpy(scope.get_current_value(scalar))) == 8.0


def test_metric_and_skipping_state_is_written_in_place_and_logged_as_float32(monkeypatch):
    # Gradient metrics and `skip_bad_steps` write their state in place
    # (`_compat.torch_assign`), not through Keras's `assign` methods (tens
    # of µs a write in a step); the skipping counts, kept as Python floats
    # in the step, are logged as float32 tensors, as on the other backends.
    from keras_keepgrad import _capture

    model = one_weight(skip_bad_steps=True)
    norm = kg.metrics.GradientNorm()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[norm])
    seen = []
    logged = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(logs))
    model.fit(X, Y, batch_size=2, verbose=0, callbacks=[logged])
    written = []  # the variables written with Keras's methods inside a step

    def spying(method):
        def spy(self, value):
            if _capture.current_step() is not None:
                written.append(self.path)
            return method(self, value)

        return spy

    for name in ("assign", "assign_add"):
        monkeypatch.setattr(keras.Variable, name, spying(getattr(keras.Variable, name)))
    bad = np.array([[np.nan], [2.0]], "float32")
    history = model.fit(bad, Y, batch_size=2, verbose=0, callbacks=[logged])
    state = {v.path for v in norm.variables + model._skipped_metric.variables}
    assert written and not state & set(written)
    # d/dw mean((w x)^2) = 2 w (1 + 4) / 2 = 15 at w = 3 on the good batch.
    assert [logs["grad_norm"] for logs in seen[:1]] == [15.0]
    assert [logs["skipped_steps"] for logs in seen] == [0.0, 1.0]
    assert history.history["skipped_steps"] == [1.0]
    # The step's own logs, before `fit` makes Python numbers of them.
    logs = model.train_function(
        [(keras.ops.convert_to_tensor(bad), keras.ops.convert_to_tensor(Y))]
    )
    value = logs["skipped_steps"]
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float32
    assert float(value) == 2.0
    # 3 - 0.1 * 15 after the good step; the NaN steps were skipped.
    assert keras.ops.convert_to_numpy(model.layers[-1].kernel).tolist() == [[1.5]]
