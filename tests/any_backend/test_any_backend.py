"""KeepGradModel cases that run unchanged on Keras's JAX and PyTorch backends.

`tests/test_backends.py` runs this directory with `tests/jax_backend`
under `KERAS_BACKEND=jax` and with `tests/torch_backend` under
`KERAS_BACKEND=torch`; the TensorFlow run of the suite, whose own tests
cover all of this, does not collect it.

The hand model: one bias-free Dense(1) with w = 3, x = [[1], [2]], y = 0,
mse. loss = mean((w*x)^2), so d/dw = 5w = 15; with SGD(0.1) w' = 1.5, then
5w' = 7.5, then 3.75.
"""

import dynamics_cases as cases
import h5py
import keras
import numpy as np
import pytest
import report_cases
import stats_cases
from conftest import W0
from conftest import LateBuilt
from conftest import X
from conftest import Y
from conftest import dense_0
from conftest import fit_batches
from conftest import fit_once
from conftest import kernel
from conftest import one_weight

import keras_keepgrad as kg

assert keras.backend.backend() in ("jax", "torch"), "run with KERAS_BACKEND=jax or torch"


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


def test_a_wrapped_subclassed_model_is_trained_and_kept():
    class Plain(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(
                1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0)
            )

        def call(self, x):
            return self.dense(x)

    plain = Plain(name="plain")
    kept = kg.keep_gradients(plain)
    assert type(kept).__name__ == "WrappedKeepGradModel"
    fit_once(kept)
    assert kept.dense is plain.dense  # read through the wrapper
    assert list(kept.get_gradients_by_path()) == ["plain/dense/kernel"]
    assert float(kept.gradients["plain"]["dense"]["kernel"][0, 0]) == 15.0
    assert float(plain.get_weights()[0][0, 0]) == 1.5


def functional(name, layer, w):
    """A functional sub-model `name` of one bias-free Dense(1) `layer` = w."""
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(w), name=layer
    )
    return keras.Model(inputs, dense(inputs), name=name)


class TwoSubModels(kg.KeepGradModel):
    """D(G(x)) with two functional sub-models, each with its own optimizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = functional("generator", "g", 3.0)
        self.discriminator = functional("discriminator", "d", 1.0)
        self.g_optimizer = keras.optimizers.SGD(0.1)
        self.d_optimizer = keras.optimizers.SGD(0.0625)

    def call(self, x):
        return self.discriminator(self.generator(x))

    def pairs(self):
        return [(self.g_optimizer, self.generator), (self.d_optimizer, self.discriminator)]


if keras.backend.backend() == "jax":

    class TwoOptimizers(TwoSubModels):
        def train_step(self, state, data):
            import jax
            import jax.numpy as jnp

            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(trainable):
                y_pred, _ = self.stateless_call(trainable, non_trainable, x)
                return jnp.mean((y_pred - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(trainable)
            trainable = list(trainable)
            position = {id(v): i for i, v in enumerate(self.trainable_variables)}
            # SGD without momentum: no optimizer state to thread through.
            for optimizer, sub in self.pairs():
                at = [position[id(v)] for v in sub.trainable_variables]
                values, _ = optimizer.stateless_apply(
                    [v.value for v in optimizer.variables],
                    [grads[i] for i in at],
                    [trainable[i] for i in at],
                )
                for i, value in zip(at, values):
                    trainable[i] = value
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

else:
    import torch

    class TwoOptimizers(TwoSubModels):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            loss = torch.mean((self(x) - y) ** 2)
            loss.backward()
            with torch.no_grad():
                for optimizer, sub in self.pairs():
                    variables = sub.trainable_variables
                    optimizer.apply([v.value.grad for v in variables], variables)
            return {"loss": loss.detach()}


def test_get_gradients_of_two_functional_sub_models():
    gan = TwoOptimizers(name="gan")
    gan(X)
    for optimizer, sub in gan.pairs():
        optimizer.build(sub.trainable_variables)
    gan.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    gan.fit(X, Y, batch_size=2, verbose=0)
    # Functional sub-models add no level: their layers are at the top level,
    # as in Keras's own state tree.
    state = gan.get_state_tree()["trainable_variables"]
    assert {k: list(v) for k, v in gan.gradients.items()} == {"g": ["kernel"], "d": ["kernel"]}
    assert {k: list(v) for k, v in state.items()} == {"g": ["kernel"], "d": ["kernel"]}
    # loss = mean((d g x)^2): d/dg = 5 g d^2 = 15, d/dd = 5 d g^2 = 45.
    g_grads = gan.get_gradients_of(gan.generator)
    d_grads = gan.get_gradients_of(gan.discriminator)
    assert {p: float(g[0, 0]) for p, g in g_grads.items()} == {"g/kernel": 15.0}
    assert {p: float(g[0, 0]) for p, g in d_grads.items()} == {"d/kernel": 45.0}
    # Each optimizer applied its own: 3 - 0.1 * 15 and 1 - 45 / 16.
    assert float(gan.generator.get_weights()[0][0, 0]) == 1.5
    assert float(gan.discriminator.get_weights()[0][0, 0]) == -1.8125
    with pytest.raises(ValueError, match="'other' is not a layer of model 'gan'"):
        gan.get_gradients_of(functional("other", "o", 1.0))


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


@pytest.mark.parametrize("cls", [keras.Model, kg.KeepGradModel])
def test_gradient_metrics_in_a_model_that_keeps_nothing_raise(cls):
    # On JAX too, where Keras's step runs the metrics in a stateless scope.
    model = one_weight(cls=cls, **({} if cls is keras.Model else {"keep_gradients": False}))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[kg.metrics.GradientNorm()]
    )
    with pytest.raises(ValueError, match=r"'grad_norm'.*keeps no gradients.*KeepGradModel"):
        model.fit(X, Y, batch_size=2, verbose=0)


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
def whole_kernel(grads):
    return grads["dense_0"]["kernel"]  # shape (1, 1): not a scalar


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
def failing(grads):
    raise ZeroDivisionError("failing fn")


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
class UpdatesByHand(kg.KeepGradModel):
    """Halves w by hand, without an optimizer or `keep_step_gradients`,
    then updates the compiled metrics: a step that keeps nothing."""

    if keras.backend.backend() == "jax":

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_values, metrics_values = state
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            mapping = list(zip(self.metrics_variables, metrics_values))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                logs = self.compute_metrics(x, y, y_pred)
            metrics_values = [scope.get_current_value(v) for v in self.metrics_variables]
            trainable = [0.5 * value for value in trainable]
            return logs, (trainable, non_trainable, optimizer_values, metrics_values)

    else:

        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            for variable in self.trainable_variables:
                variable.assign(0.5 * keras.ops.convert_to_numpy(variable))
            return self.compute_metrics(x, y, self(x))


# `(model, metric, error, message)` of each error a gradient metric raises.
FAILING = {
    "keep_gradients=False": (
        lambda: one_weight(keep_gradients=False),
        kg.metrics.GradientNorm,
        ValueError,
        r"'grad_norm'.*keeps no gradients.*Received: keep_gradients=False",
    ),
    "keeps_nothing": (
        lambda: one_weight(cls=UpdatesByHand),
        kg.metrics.GradientNorm,
        ValueError,
        r"'grad_norm'.*before any optimizer received gradients.*keep_step_gradients",
    ),
    "non_scalar": (
        one_weight,
        lambda: kg.metrics.GradientMetric(whole_kernel),
        ValueError,
        r"'whole_kernel' must return a scalar.*\(1, 1\)",
    ),
    "fn_raises": (
        one_weight,
        lambda: kg.metrics.GradientMetric(failing),
        ZeroDivisionError,
        "failing fn",
    ),
}


@pytest.mark.parametrize("case", list(FAILING))
def test_a_gradient_metric_error_comes_before_anything_changes(case, mode, tmp_path):
    # On JAX the error used to leave the variables without values (Keras's
    # `fit` detaches them while its steps run); on PyTorch it came after
    # the step's update.
    make, metric, error, match = FAILING[case]
    model = make()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae", metric()], **mode
    )
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=2, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], [[W0]])  # not 1.5
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0
    values = [float(np.sum(np.abs(keras.ops.convert_to_numpy(v)))) for v in model.metrics_variables]
    assert values == [0.0] * len(values)
    model.save(tmp_path / "model.keras")
    assert keras.models.load_model(tmp_path / "model.keras").get_weights()[0][0, 0] == W0


def test_a_stale_training_function_is_refused_before_its_first_batch(tmp_path):
    inputs = keras.Input((1,))
    hidden = dense_0(name="hidden", w=2.0)
    model = kg.KeepGradModel(inputs, dense_0(name="head")(hidden(inputs)))
    hidden.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    # y = 3*2*x: d/dw_head = 2*mean(y*2x) = 24*2.5 = 60, so w_head = 3 - 6.
    weights = [[[2.0]], [[-3.0]]]
    np.testing.assert_array_equal(model.get_weights(), weights)
    hidden.trainable = True  # without `compile`: the old training function
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "g{step}.npz"), every=1)
    if keras.backend.backend() == "jax":
        error, match = RuntimeError, r"GradientSnapshot .*stale.*\['hidden/kernel'\]"
    else:
        # The PyTorch step follows the change, and Keras's optimizer refuses
        # the variable it was not built with.
        error, match = ValueError, "Unknown variable.*hidden/kernel"
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=2, verbose=0, callbacks=[snapshot])
    assert snapshot.files == []
    np.testing.assert_array_equal(model.get_weights(), weights)  # no batch applied
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1
    model.save(tmp_path / "model.keras")


def test_gradient_metrics_over_two_steps_and_evaluation():
    model = one_weight()
    history = fit_once(model, batches=2, metrics=[kg.metrics.GradientNorm(reduction="last")])
    assert history.history["grad_norm"] == [7.5]
    assert "grad_norm" not in model.evaluate(X, Y, verbose=0, return_dict=True)


def _epoch_with_validation(model, metrics, x, y, **compile_kwargs):
    """Fits one epoch of `x`, `y` in batches of two with `X`, `Y` as
    validation data; returns the `History`'s dict."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=metrics, **compile_kwargs
    )
    return model.fit(x, y, batch_size=2, shuffle=False, verbose=0, validation_data=(X, Y)).history


def test_every_reduction_survives_validation(mode):
    # Validation resets the metrics after the epoch's values were taken:
    # those must be copies. Two steps see w = 3, 1.5: gradients 15, 7.5,
    # update ratios 1/2, 1/2.
    metrics = [
        *(kg.metrics.GradientNorm(name=r, reduction=r) for r in ("sum", "last", "mean", "max")),
        kg.metrics.GradientNorm(per_layer=True, name="layers", reduction="sum"),
        kg.metrics.GradientMaxAbs(reduction="last"),
        kg.metrics.UpdateRatio(reduction="sum"),
        kg.metrics.VanishingGradients(threshold=10.0, reduction="sum"),  # only 7.5 < 10
        kg.metrics.GradientMetric(
            lambda g: g["dense_0"]["kernel"][0, 0], name="k", reduction="last"
        ),
    ]
    expected = {
        "sum": 22.5,
        "last": 7.5,
        "mean": 11.25,
        "max": 15.0,
        "layers/dense_0": 22.5,
        "grad_max_abs": 7.5,
        "update_ratio": 1.0,
        "grad_vanishing": 1.0,
        "k": 7.5,
    }
    model = one_weight()
    history = _epoch_with_validation(model, metrics, np.tile(X, (2, 1)), np.tile(Y, (2, 1)), **mode)
    assert {k: history[k] for k in expected} == {k: [v] for k, v in expected.items()}
    assert history["val_loss"] == [1.40625]  # w = 0.75: mean((0.75 x)^2)
    # A reset leaves the results already taken. One more step, at w = 0.75:
    # gradient 3.75, update ratio 1/2.
    model.train_on_batch(X, Y)
    results = {k: v for m in metrics for k, v in m.result().items()}
    for m in metrics:
        m.reset_state()
    assert {k: float(v) for k, v in results.items()} == {
        **dict.fromkeys(expected, 3.75),
        "update_ratio": 0.5,
        "grad_vanishing": 1.0,
    }


def test_non_finite_gradients_count_nan_steps_with_validation():
    # NaN inputs: every step's gradient is NaN.
    nan = np.full((6, 1), np.nan, "float32")
    history = _epoch_with_validation(
        one_weight(), [kg.metrics.NonFiniteGradients()], nan, np.zeros((6, 1), "float32")
    )
    assert history["grad_nonfinite"] == [3.0]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_is_unscaled(policy):
    keras.config.set_dtype_policy(policy)
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if policy == "mixed_float16":
        # Keras wraps the optimizer itself under mixed_float16.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rec = fit_batches(model, 4)
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
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    rec = fit_batches(model, 5)
    assert rec.seen == [15.0, 15.0, 3.75, 3.75, 0.9375]


@pytest.mark.parametrize("keep_every", [1, 2])
def test_kept_step_says_which_step_the_slots_hold(mode, keep_every):
    model = one_weight(keep_every=keep_every)
    assert model.kept_step is None  # before the first step
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(model.kept_step)
    )
    fit_batches(model, 4, callbacks=[record])
    assert [kept.paths for kept in seen] == [("dense_0/kernel",)] * 4
    if keep_every == 1:
        assert [(kept.write, kept.age) for kept in seen] == [(None, 0)] * 4
    else:
        # Steps 1 and 3 write the slots: steps 2 and 4 hold the one before.
        assert [kept.age for kept in seen] == [0, 1, 0, 1]
        writes = [kept.write for kept in seen]
        assert writes[0] == writes[1] != writes[2] == writes[3]
    model.keep_gradients = False
    assert model.kept_step is None


def test_kept_step_of_a_step_that_keeps_nothing_has_no_paths():
    model = one_weight(cls=UpdatesByHand)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert model.kept_step == ((), None, 0)
    assert float(model.get_weights()[0][0, 0]) == 1.5  # halved by hand


def test_train_on_batch_and_nothing_before_the_first_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(RuntimeError, match="no kept gradients yet"):
        model.gradients
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 7.5


def test_kept_gradients_are_not_weights_and_save_only_when_asked(tmp_path):
    model = one_weight()
    fit_once(model)
    assert len(model.weights) == 1
    path = str(tmp_path / "plain.weights.h5")
    model.save_weights(path)
    fresh = one_weight()
    fresh.load_weights(path)
    assert float(fresh.get_weights()[0][0, 0]) == 1.5

    with h5py.File(path) as f:
        assert "_kept_gradients" not in str(list(f.keys())) and "vars" in f["layers/dense"]

    saving = one_weight(save_gradients=True)
    fit_once(saving)
    with_grads = str(tmp_path / "kept.weights.h5")
    saving.save_weights(with_grads)
    with h5py.File(with_grads) as f:
        assert f["_kept_gradients/vars/0:dense_0%2Fkernel"][()].tolist() == [[15.0]]
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


def test_other_backends_named_in_the_error(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    match = r"requires the TensorFlow, the JAX or the PyTorch backend.*KERAS_BACKEND='numpy'"
    with pytest.raises(RuntimeError, match=match):
        one_weight()


# Variables sharing a path -------------------------------------------------


def out_model(w, name="out"):
    """`Input((1,)) -> Dense(1, name=name)` with kernel `w`, bias 0. A
    functional model's layers are built before it, so the paths are
    "out/kernel" and "out/bias" whatever the model's name."""
    inputs = keras.Input((1,))
    out = keras.layers.Dense(1, name=name, kernel_initializer=keras.initializers.Constant(w))
    return keras.Model(inputs, out(inputs))


class TwoOuts(kg.KeepGradModel):
    """Two sub-models with layers named `names`. `update`: "keras" (Keras's
    step), "one" optimizer for both, "two" (an SGD each), "keep" (by hand,
    through `keep_step_gradients`), in a step of the backend's own kind.

    y = w1 (w0 x + b0) + b1 with w0 = 3, w1 = 1, biases 0: the gradients
    are 5 w0 w1^2 = 15 and 5 w1 w0^2 = 45 for the kernels, 2 mean(3x) = 9
    for either bias."""

    def __init__(self, update, names=("out", "out"), **kwargs):
        super().__init__(**kwargs)
        self.update = update
        self.first = out_model(3.0, names[0])
        self.second = out_model(1.0, names[1])
        self.opt_a = keras.optimizers.SGD(0.1)
        self.opt_b = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, *args):
        if self.update == "keras":
            return super().train_step(*args)
        if keras.backend.backend() == "jax":
            return self._stateless_step(*args)
        return self._torch_step(*args)

    def _stateless_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data

        def loss_fn(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            return keras.ops.mean((y_pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        if self.update == "one":
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
        elif self.update == "two":
            # SGD without momentum: no optimizer state to thread through.
            halves = []
            for opt, part in ((self.opt_a, slice(0, 2)), (self.opt_b, slice(2, 4))):
                values, _ = opt.stateless_apply(
                    [v.value for v in opt.variables], grads[part], trainable[part]
                )
                halves.extend(values)
            trainable = halves
        else:
            grads = self.keep_step_gradients(grads, self.trainable_variables)
            trainable = [v - 0.1 * g for v, g in zip(trainable, grads)]
        return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    def _torch_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        loss = torch.mean((self(x) - y) ** 2)
        loss.backward()
        variables = self.trainable_variables
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            if self.update == "one":
                self.optimizer.apply(grads, variables)
            elif self.update == "two":
                self.opt_a.apply(grads[:2], variables[:2])
                self.opt_b.apply_gradients(zip(grads[2:], variables[2:]))
            else:
                for v, g in zip(variables, self.keep_step_gradients(grads, variables)):
                    v.assign(v.value - 0.1 * g)
        return {"loss": loss.detach()}


def two_outs(update, names=("out", "out"), **compile_kwargs):
    model = TwoOuts(update, names)
    model(X)
    model.opt_a.build(model.first.trainable_variables)
    model.opt_b.build(model.second.trainable_variables)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model


@pytest.mark.parametrize("update", ["keras", "one", "two", "keep"])
def test_variables_sharing_a_path_raise_before_anything_changes(mode, update):
    model = two_outs(update, **mode)
    match = r"share the paths 'out/bias', 'out/kernel': one .* distinct `name`s"
    with pytest.raises(ValueError, match=match):
        model.fit(X, Y, batch_size=2, verbose=0)
    # Kernels 3 and 1, biases 0: nothing was updated.
    assert [w.tolist() for w in model.get_weights()] == [[[3.0]], [0.0], [[1.0]], [0.0]]
    optimizers = [model.optimizer, model.opt_a, model.opt_b]
    assert [int(o.iterations) for o in optimizers] == [0, 0, 0]

    # With distinct names the same step keeps all four gradients.
    model = two_outs(update, names=("a", "b"), **mode)
    model.fit(X, Y, batch_size=2, verbose=0)
    kept = {path: np.asarray(g).tolist() for path, g in model.get_gradients_by_path().items()}
    assert kept == {"a/kernel": [[15.0]], "a/bias": [9.0], "b/kernel": [[45.0]], "b/bias": [9.0]}


# Callbacks (they write through TensorFlow's `tf.summary`, as Keras's own
# TensorBoard callback does on every backend) -------------------------------


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_callbacks_read_every_step(tmp_path, dtype):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    # 15, 7.5, 3.75 and SGD(0.1)'s steps between them are exact in bfloat16.
    model = one_weight(dtype=dtype)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    monitor = kg.callbacks.GradientMonitor(check_freq=1)
    callbacks = [
        kg.callbacks.GradientTensorBoard(
            str(tmp_path / "tb"), update_freq=1, gradient_histogram_freq=1
        ),
        monitor,
        kg.callbacks.GradientSnapshot(str(tmp_path / "snap" / "{step:03d}.npz"), every=1),
    ]
    model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    snaps = [np.load(tmp_path / "snap" / f"{step:03d}.npz") for step in (1, 2, 3)]
    assert [float(s["dense_0/kernel"][0, 0]) for s in snaps] == [15.0, 7.5, 3.75]
    assert snaps[0]["dense_0/kernel"].dtype == np.float32  # bfloat16 is stored as float32
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb" / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()

    def written(tag):
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]

    # log10 of each norm, written once, as float32; the layer's tag is its path.
    log10 = [(s, float(np.float32(np.log10(v)))) for s, v in [(1, 15.0), (2, 7.5), (3, 3.75)]]
    assert written("gradients/log10_norm/dense_0") == log10
    assert written("gradients/log10_global_norm") == log10
    # No non-finite step: the count, 0, at the first step and the epoch's last.
    assert written("gradients/nonfinite_steps") == [(1, 0.0), (3, 0.0)]
    # A histogram of each step's one value: its buckets span exactly it.
    histograms = [
        tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors("dense_0/kernel/gradient")
    ]
    assert [(h[:, 0].min(), h[:, 1].max(), h[:, 2].sum()) for h in histograms] == [
        (15.0, 15.0, 1.0),
        (7.5, 7.5, 1.0),
        (3.75, 3.75, 1.0),
    ]
    assert monitor.events == []  # nothing non-finite, vanishing or exploding


@pytest.mark.parametrize("own_step", [False, True], ids=["keras_step", "own_step"])
def test_snapshot_of_a_model_built_by_its_first_batch(tmp_path, own_step):
    # 5w = 15, then w = 3 - 0.1 * 15 = 1.5 and 5w = 7.5.
    model = LateBuilt(own_step=own_step, name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "g_{step}.npz"), every=1)
    monitor = kg.callbacks.GradientMonitor(check_freq=1)
    model.fit(np.tile(X, (2, 1)), np.tile(Y, (2, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=[snapshot, monitor])  # fmt: skip
    assert snapshot.files == [str(tmp_path / "g_1.npz"), str(tmp_path / "g_2.npz")]
    found = []
    for filename in snapshot.files:
        with np.load(filename) as data:
            assert sorted(data.files) == ["epoch", "loss_scale", "net/dense_0/kernel", "step"]
            found.append(
                (int(data["step"]), int(data["epoch"]), data["net/dense_0/kernel"].tolist())
            )
    assert found == [(1, 1, [[15.0]]), (2, 1, [[7.5]])]
    assert monitor.events == []


@pytest.mark.parametrize("own_step", [False, True], ids=["keras_step", "own_step"])
def test_metrics_of_a_model_built_by_its_first_batch(own_step):
    # w = 3 -> 1.5 with SGD(0.1): update ratio 1.5 / 3.
    model = LateBuilt(own_step=own_step, name="net")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=[kg.metrics.UpdateRatio(), kg.metrics.GradientNorm(per_layer=True)],
    )
    history = model.fit(X, Y, batch_size=2, verbose=0).history
    assert history["update_ratio"] == [0.5]
    assert history["grad_norm/net/dense_0"] == [15.0]
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=[
            kg.metrics.GradientNorm(per_layer=True),
            kg.metrics.GradientNorm(per_layer=True, reduction="max"),
        ],
    )
    with pytest.raises(ValueError, match="same name 'grad_norm/net/dense_0'"):
        model.fit(X, Y, batch_size=2, verbose=0)
    assert model.dense.kernel.numpy().tolist() == [[1.5]]  # checked before the update


# The training-dynamics metrics: the cases of `test_dynamics.py`, with the
# same numbers (derivations in `dynamics_cases.py`) ---------------------------


@pytest.mark.parametrize(
    "index", range(len(cases.ARGUMENTS)), ids=[a["name"] for a in cases.ARGUMENTS]
)
def test_dynamics_config_round_trip(index):
    cases.config_round_trip(cases.all_metrics()[index], cases.ARGUMENTS[index])


@pytest.mark.parametrize("case", cases.MODE_CASES, ids=lambda c: c.__name__)
def test_dynamics_hand_case_in_every_mode(case, mode):
    case(mode)


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.__name__)
def test_dynamics_hand_case(case):
    case()


def test_dynamics_state_stays_out_of_the_weights_and_the_saved_files(tmp_path):
    cases.state_stays_out_of_the_weights_and_the_saved_files(tmp_path)


@pytest.mark.slow
def test_dynamics_noise_scale_matches_the_closed_form_on_one_device():
    cases.noise_scale_matches_the_closed_form_on_one_device()


# GradientReport and GradientMonitor's states (cases in report_cases.py) ----


def test_report_values_by_hand(tmp_path, capsys):
    report_cases.report_values_by_hand(tmp_path, capsys)


def test_report_verdicts():
    report_cases.report_verdicts()


def test_monitor_defaults_catch_vanishing_and_exploding():
    report_cases.monitor_defaults_catch_vanishing_and_exploding()


def test_monitor_reports_a_state_once_with_its_end():
    report_cases.monitor_reports_a_state_once_with_its_end()


# The statistics the callbacks read: computed in the step ---------------------


def test_a_metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch, mode):
    stats_cases.metric_and_two_callbacks_read_the_step_statistics(tmp_path, monkeypatch, **mode)


def test_step_statistics_under_keep_every_describe_the_kept_step(monkeypatch, mode):
    stats_cases.keep_every_describes_the_step_the_slots_hold(monkeypatch, **mode)


def test_step_statistics_of_a_nonfinite_step(tmp_path, mode):
    stats_cases.a_nonfinite_step_is_recorded_and_reported(tmp_path, **mode)
