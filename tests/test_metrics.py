"""Tests of `keras_keepgrad.metrics` on numbers a person can check by hand.

The one-weight model (conftest.py): w = 3, x = [[1], [2]], y = 0, mse, so
the gradient is 5w and SGD(0.1) halves w every step: one-batch epochs give
grad_norm = 5 * W0 * 0.5**k = 15, 7.5, 3.75, ...

The two-layer chain: out = b * (a * x), a = 1, b = 2, so y_pred = [2, 4],
dL/dy_pred = y_pred (mean of two squares), dL/da = 2*2*1 + 4*2*2 = 20 and
dL/db = 2*1 + 4*2 = 10.
"""

import csv
import math

import keras
import numpy as np
import pytest
from conftest import MODES
from conftest import STEP_IDS
from conftest import W0
from conftest import LateBuilt
from conftest import UpdatesByHand
from conftest import X
from conftest import Y
from conftest import compiled_on_torch_only
from conftest import dense_0
from conftest import modes
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad import _compat
from keras_keepgrad import metrics as kgm

SPE = "Keras's PyTorch trainer refuses steps_per_execution > 1"
X3 = np.tile(X, (3, 1))  # three identical batches of two
Y3 = np.tile(Y, (3, 1))


def chain(a=1.0, b=2.0, freeze_a=False):
    inputs = keras.Input((1,))
    first = dense_0(name="a", w=a)
    first.trainable = not freeze_a
    outputs = dense_0(name="b", w=b)(first(inputs))
    return kg.KeepGradModel(inputs, outputs)


def fit(model, metrics, x=X, y=Y, epochs=1, optimizer=None, compile_kwargs=None, **kwargs):
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=metrics,
        **(compile_kwargs or {}),
    )
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, **kwargs).history


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
def kernel_grad(grads):
    return grads["dense_0"]["kernel"][0, 0]


# --- serialization first ----------------------------------------------------

ALL = [
    kgm.GradientMetric(kernel_grad, name="k", reduction="last"),
    kgm.GradientNorm(),
    kgm.GradientNorm(per_layer=True, name="gn", reduction="max"),
    kgm.GradientMaxAbs(),
    kgm.NonFiniteGradients(),
    kgm.VanishingGradients(threshold=0.5),
    kgm.UpdateRatio(per_layer=True),
]


# Every constructor argument of each entry of ALL, as given or defaulted.
ARGUMENTS = [
    dict(name="k", reduction="last", fn=kernel_grad),
    dict(name="grad_norm", reduction="mean", per_layer=False),
    dict(name="gn", reduction="max", per_layer=True),
    dict(name="grad_max_abs", reduction="max"),
    dict(name="grad_nonfinite", reduction="sum"),
    dict(name="grad_vanishing", reduction="mean", threshold=0.5),
    dict(name="update_ratio", reduction="mean", per_layer=True),
]


@pytest.mark.parametrize(
    "metric, arguments", list(zip(ALL, ARGUMENTS)), ids=lambda m: getattr(m, "name", "")
)
def test_config_round_trip(metric, arguments):
    config = metric.get_config()
    # A config that dropped an argument would round-trip to the default.
    assert sorted(config) == sorted(arguments)
    clone = type(metric).from_config(config)
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(metric))
    assert type(revived) is type(metric)
    for copy in (clone, revived):
        assert {k: getattr(copy, k) for k in arguments} == arguments
        assert copy.get_config() == config


def test_builtin_names_and_defaults():
    assert [m.name for m in ALL[1:]] == [
        "grad_norm",
        "gn",
        "grad_max_abs",
        "grad_nonfinite",
        "grad_vanishing",
        "update_ratio",
    ]
    assert kgm.GradientNorm().reduction == "mean"
    assert kgm.GradientMaxAbs().reduction == "max"
    assert kgm.NonFiniteGradients().reduction == "sum"
    assert kgm.GradientMetric(kernel_grad).name == "kernel_grad"
    assert kgm.GradientMetric(lambda g: 0.0).name == "gradient_metric"
    # Nothing to report before a training step.
    assert kgm.GradientNorm().result() == {}


def test_lambda_follows_keras_rule_for_lambdas():
    metric = kgm.GradientMetric(lambda g: 0.0, name="zero")
    with pytest.warns(UserWarning, match="lambda"):
        config = keras.saving.serialize_keras_object(metric)
    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.deserialize_keras_object(config)


# --- values -----------------------------------------------------------------


@pytest.mark.not_compiled_on_torch(
    reason="a metric's update and result: test_metrics_of_a_model_built_by_its_first_batch"
)
@pytest.mark.parametrize("mode", list(MODES))
def test_one_batch_epochs_halve_the_norm(mode):
    history = fit(
        one_weight(),
        [
            "mae",
            kgm.GradientNorm(),
            kgm.GradientMaxAbs(),
            kgm.GradientMetric(kernel_grad),
            kgm.UpdateRatio(),
            kgm.NonFiniteGradients(),
        ],
        epochs=3,
        compile_kwargs=MODES[mode],
    )
    expected = [5 * W0 * 0.5**k for k in range(3)]  # 15, 7.5, 3.75
    assert history["grad_norm"] == expected
    assert history["grad_max_abs"] == expected
    assert history["kernel_grad"] == expected
    # SGD(0.1) moves w by 0.1 * 5w = w / 2 every step.
    assert history["update_ratio"] == [0.5, 0.5, 0.5]
    assert history["grad_nonfinite"] == [0.0, 0.0, 0.0]
    assert history["mae"] == [4.5, 2.25, 1.125]


@pytest.mark.parametrize(
    "steps_per_execution",
    [1, pytest.param(3, marks=pytest.mark.backends("tensorflow", "jax", reason=SPE))],
)
def test_reductions_over_a_three_step_epoch(steps_per_execution):
    # Steps see w = 3, 1.5, 0.75: gradients 15, 7.5, 3.75.
    history = fit(
        one_weight(),
        [
            kgm.GradientNorm(),
            kgm.GradientNorm(name="last", reduction="last"),
            kgm.GradientNorm(name="sum", reduction="sum"),
            kgm.GradientNorm(name="max", reduction="max"),
        ],
        x=X3,
        y=Y3,
        compile_kwargs=dict(steps_per_execution=steps_per_execution),
    )
    assert history["grad_norm"] == [(15 + 7.5 + 3.75) / 3]  # 8.75
    assert history["last"] == [3.75]
    assert history["sum"] == [26.25]
    assert history["max"] == [15.0]


@pytest.mark.not_compiled_on_torch(
    reason="read in validation: test_hand_case_in_every_mode[jit-sum_and_last_survive_validation]"
)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_reduction_survives_validation(mode):
    # Validation resets the metrics after the epoch's values were taken.
    # Two steps see w = 3, 1.5: gradients 15, 7.5, update ratios 1/2, 1/2.
    history = fit(
        one_weight(),
        [
            *(kgm.GradientNorm(name=r, reduction=r) for r in ("sum", "last", "mean", "max")),
            kgm.GradientNorm(per_layer=True, name="layers", reduction="sum"),
            kgm.UpdateRatio(reduction="sum"),
            kgm.GradientMetric(kernel_grad, reduction="last"),
        ],
        x=X3[:4],
        y=Y3[:4],
        validation_data=(X, Y),
        compile_kwargs=MODES[mode],
    )
    assert history["sum"] == [22.5]
    assert history["last"] == [7.5]
    assert history["mean"] == [11.25]
    assert history["max"] == [15.0]
    assert history["layers/dense_0"] == [22.5]
    assert history["update_ratio"] == [1.0]
    assert history["kernel_grad"] == [7.5]
    assert history["val_loss"] == [1.40625]  # w = 0.75: mean((0.75 x)^2)


def test_non_finite_gradients_count_nan_steps_with_validation():
    # NaN inputs: every step's gradient is NaN.
    history = fit(
        one_weight(),
        [kgm.NonFiniteGradients()],
        x=np.full((6, 1), np.nan, "float32"),
        y=np.zeros((6, 1), "float32"),
        validation_data=(X, Y),
    )
    assert history["grad_nonfinite"] == [3.0]


def test_per_layer_keys_and_values():
    history = fit(
        chain(),
        [
            kgm.GradientNorm(),
            kgm.GradientNorm(per_layer=True),
            kgm.GradientMaxAbs(),
            kgm.VanishingGradients(threshold=15.0),
            kgm.UpdateRatio(per_layer=True),
            kgm.UpdateRatio(),
        ],
    )
    assert history["grad_norm/a"] == [20.0]
    assert history["grad_norm/b"] == [10.0]
    assert history["grad_norm"] == [pytest.approx(math.sqrt(500.0))]
    assert history["grad_max_abs"] == [20.0]
    assert history["grad_vanishing"] == [0.5]  # layer b: 10 < 15
    # a: 1 -> 1 - 0.1*20 = -1 (|Δ| = 2); b: 2 -> 2 - 0.1*10 = 1 (|Δ| = 1).
    assert history["update_ratio/a"] == [2.0]
    assert history["update_ratio/b"] == [0.5]
    assert history["update_ratio"] == [1.0]  # sqrt(4 + 1) / sqrt(1 + 4)
    assert sorted(k for k in history if "/" in k) == [
        "grad_norm/a",
        "grad_norm/b",
        "update_ratio/a",
        "update_ratio/b",
    ]


def test_one_layer_norm_covers_kernel_and_bias():
    # w = -1, b = 3: y_pred = [2, 1], dL/dw = 2*1 + 1*2 = 4, dL/db = 2 + 1 = 3.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.Constant(-1.0),
        bias_initializer=keras.initializers.Constant(3.0),
        name="dense_0",
    )(inputs)
    history = fit(kg.KeepGradModel(inputs, outputs), [kgm.GradientNorm(per_layer=True)])
    assert history == {"grad_norm/dense_0": [5.0], "loss": [2.5]}


def test_frozen_layers_are_absent():
    # Only b trains: dL/db = 10.
    history = fit(
        chain(freeze_a=True),
        [kgm.GradientNorm(), kgm.GradientNorm(per_layer=True), kgm.VanishingGradients()],
    )
    assert history["grad_norm"] == [10.0]
    assert [k for k in history if k.startswith("grad_norm/")] == ["grad_norm/b"]
    assert history["grad_vanishing"] == [0.0]


@pytest.mark.not_compiled_on_torch(
    reason="a metric's update and result: test_metrics_of_a_model_built_by_its_first_batch"
)
@pytest.mark.parametrize("mode", modes("graph", "jit"))
def test_sparse_gradients_sum_duplicate_rows(mode):
    # Both samples look up row 0 (value 3): loss = mean(e0^2) -> d/de0 = 6,
    # the sum of the two IndexedSlices rows of 3 each.
    inputs = keras.Input((1,), dtype="int32")
    embedded = keras.layers.Embedding(
        3, 1, embeddings_initializer=keras.initializers.Constant(3.0)
    )(inputs)
    model = kg.KeepGradModel(inputs, keras.layers.Flatten()(embedded))
    history = fit(
        model,
        [kgm.GradientNorm(), kgm.GradientMaxAbs()],
        x=np.zeros((2, 1), "int32"),
        compile_kwargs=MODES[mode],
    )
    assert history["grad_norm"] == [6.0]
    assert history["grad_max_abs"] == [6.0]


def test_mixed_precision_values_are_unscaled_float32():
    keras.config.set_dtype_policy("mixed_float16")
    dtypes = []

    def kernel_dtype(grads):
        dtypes.append(grads["dense_0"]["kernel"].dtype)
        return grads["dense_0"]["kernel"][0, 0]

    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)
    history = fit(
        one_weight(),
        [kgm.GradientNorm(), kgm.GradientMetric(kernel_dtype)],
        optimizer=optimizer,
    )
    assert history["grad_norm"] == [15.0]  # not 15 * 1024
    assert history["kernel_dtype"] == [15.0]
    assert dtypes and all(keras.backend.standardize_dtype(d) == "float32" for d in dtypes)


def test_non_finite_gradients_count_the_skipped_steps():
    # float16 layer: dL/dw = 15 * scale overflows float16 (max 65504) for
    # scale >= 8192. Scales 16384 and 8192 overflow and are skipped (the
    # scale halves each time); 4096 gives 61440, finite, and w moves.
    inputs = keras.Input((1,))
    model = kg.KeepGradModel(inputs, dense_0(dtype="mixed_float16")(inputs))
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**14
    )
    history = fit(
        model,
        [kgm.NonFiniteGradients(), kgm.GradientNorm(name="last_norm", reduction="last")],
        x=X3,
        y=Y3,
        epochs=2,
        optimizer=optimizer,
    )
    assert history["grad_nonfinite"] == [2.0, 0.0]
    assert float(optimizer.dynamic_scale) == 4096.0
    # Epoch 1's last step saw w = 3 (two skipped steps); epoch 2 then runs
    # on w = 1.5, 0.75, 0.375.
    assert history["last_norm"] == [15.0, 1.875]


def test_train_on_batch_reports_the_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[kgm.GradientNorm()])
    assert model.train_on_batch(X, Y, return_dict=True) == {"grad_norm": 15.0, "loss": 22.5}
    # Keras 3.15 resets the metrics on each call; earlier releases report
    # the running means of the calls so far: (22.5 + 5.625) / 2, (15 + 7.5) / 2.
    expected = [5.625, 7.5] if _compat.KERAS_VERSION >= (3, 15) else [14.0625, 11.25]
    assert model.train_on_batch(X, Y) == expected


# --- where they show up, and where not --------------------------------------


def test_history_csv_logger_and_progress_bar(tmp_path, capsys):
    path = str(tmp_path / "log.csv")
    history = fit(
        chain(),
        ["mae", kgm.GradientNorm(), kgm.GradientNorm(per_layer=True)],
        epochs=2,
        validation_data=(X, Y),
        callbacks=[keras.callbacks.CSVLogger(path)],
        verbose=2,
    )
    keys = {"grad_norm", "grad_norm/a", "grad_norm/b", "loss", "mae", "val_loss", "val_mae"}
    assert set(history) == keys
    assert "grad_norm: 22.36" in capsys.readouterr().out
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == keys | {"epoch"}
    assert [float(r["grad_norm/a"]) for r in rows] == history["grad_norm/a"]
    assert float(rows[0]["grad_norm/b"]) == 10.0


class _LogKeys(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.test_batch_keys = set()

    def on_test_batch_end(self, batch, logs=None):
        self.test_batch_keys |= set(logs)


@pytest.mark.backends("tensorflow", "jax", reason=SPE)
@pytest.mark.parametrize("mode", modes("eager", "graph"))
def test_evaluate_and_predict_have_no_gradient_values(mode):
    model = one_weight()
    metrics = ["mae", kgm.GradientNorm(), kgm.GradientNorm(per_layer=True), kgm.UpdateRatio()]
    recorder = _LogKeys()
    history = fit(
        model,
        metrics,
        x=X3,
        y=Y3,
        validation_data=(X3, Y3),
        compile_kwargs=dict(steps_per_execution=2, **MODES[mode]),
    )
    assert "grad_norm" in history and not any(k.startswith("val_grad") for k in history)
    assert not any(k.startswith("val_update") for k in history)
    results = model.evaluate(
        X3, Y3, batch_size=2, verbose=0, return_dict=True, callbacks=[recorder]
    )
    assert set(results) == {"loss", "mae"}
    assert recorder.test_batch_keys == {"loss", "mae"}
    assert len(model.evaluate(X, Y, verbose=0)) == 2  # [loss, mae]
    assert set(model.test_on_batch(X, Y, return_dict=True)) == {"loss", "mae"}
    assert model.predict(X, verbose=0).shape == (2, 1)
    # Evaluation did not touch the weight copies: the next update is 1/2.
    assert fit(model, metrics, epochs=1)["update_ratio"] == [0.5]


def test_evaluate_before_any_training():
    model = one_weight()
    model.compile(optimizer="sgd", loss="mse", metrics=[kgm.GradientNorm(per_layer=True)])
    assert model.evaluate(X, Y, verbose=0, return_dict=True) == {"loss": 22.5}


def test_per_output_lists_log_under_the_metric_name():
    # Two outputs a, b (w = 1 each): each output's loss gives dL/dw = 5.
    inputs = keras.Input((1,))
    model = kg.KeepGradModel(
        inputs, [dense_0(name="a", w=1.0)(inputs), dense_0(name="b", w=1.0)(inputs)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=["mse", "mse"],
        metrics=[["mae", kgm.GradientNorm(per_layer=True)], [kgm.GradientNorm()]],
    )
    history = model.fit(X, [Y, Y], batch_size=2, verbose=0).history
    assert history["grad_norm/a"] == [5.0] and history["grad_norm/b"] == [5.0]
    assert history["grad_norm"] == [pytest.approx(math.sqrt(50.0))]
    assert "a_mae" in history and not any(k.endswith("_grad_norm") for k in history)


def test_update_ratio_is_the_update_adam_made():
    # Adam's first step moves w by lr * m_hat / (sqrt(v_hat) + eps) = lr:
    # ratio 0.01 / 3, where lr * grad / w would be 0.05.
    history = fit(one_weight(), [kgm.UpdateRatio()], optimizer=keras.optimizers.Adam(0.01))
    assert history["update_ratio"] == [pytest.approx(0.01 / 3, rel=1e-5)]


# --- saving -------------------------------------------------------------------


def test_saved_model_loads_and_trains_again(tmp_path):
    model = one_weight()
    metrics = [
        "mae",
        kgm.GradientNorm(),
        kgm.GradientNorm(per_layer=True, name="layer_norm"),
        kgm.GradientMetric(kernel_grad, name="k", reduction="last"),
        kgm.NonFiniteGradients(),
        kgm.VanishingGradients(threshold=0.5),
        kgm.UpdateRatio(),
    ]
    assert fit(model, metrics)["grad_norm"] == [15.0]
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    names = [getattr(m, "name", m) for m in loaded._compile_config.config["metrics"]]
    assert names == [
        "mae",
        "grad_norm",
        "layer_norm",
        "k",
        "grad_nonfinite",
        "grad_vanishing",
        "update_ratio",
    ]
    history = loaded.fit(X, Y, batch_size=2, verbose=0).history  # w = 1.5
    assert history["grad_norm"] == [7.5]
    assert history["layer_norm/dense_0"] == [7.5]
    assert history["k"] == [7.5]
    assert history["update_ratio"] == [0.5]
    assert history["grad_vanishing"] == [0.0]


# --- bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: one_weight(cls=keras.Model),
        lambda: one_weight(keep_gradients=False),
    ],
    ids=["keras.Model", "keep_gradients=False"],
)
def test_model_without_kept_gradients_fails(make):
    model = make()
    model.compile(optimizer="sgd", loss="mse", metrics=[kgm.GradientNorm()])
    with pytest.raises(ValueError, match=r"'grad_norm'.*KeepGradModel.*keep_gradients"):
        model.fit(X, Y, verbose=0)


def test_two_gradient_metrics_of_one_name_are_refused_before_training():
    model = one_weight()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=[kgm.GradientNorm(), kgm.GradientNorm(reduction="max")],
    )
    match = (
        r"in `compile\(metrics=...\)` log under the same name 'grad_norm'.*"
        r"name='grad_norm_2'"
    )
    with pytest.raises(ValueError, match=match):
        model.fit(X, Y, batch_size=2, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], [[3.0]])  # untouched
    # Per-layer keys are checked too: "grad_norm/dense_0" twice.
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=[
            kgm.GradientNorm(per_layer=True),
            kgm.GradientNorm(per_layer=True, reduction="max"),
        ],
    )
    with pytest.raises(ValueError, match="same name 'grad_norm/dense_0'"):
        model.fit(X, Y, batch_size=2, verbose=0)
    # Named apart, both are logged.
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=[kgm.GradientNorm(), kgm.GradientNorm(reduction="max", name="grad_norm_max")],
    )
    history = model.fit(X, Y, batch_size=2, verbose=0).history
    assert (history["grad_norm"], history["grad_norm_max"]) == ([15.0], [15.0])


@pytest.mark.parametrize(
    "own_step",
    compiled_on_torch_only(
        [False, True],
        [False],
        reason="an own step built so: test_callbacks_of_a_model_built_by_its_first_batch",
        ids=STEP_IDS.get,
    ),
)
def test_metrics_of_a_model_built_by_its_first_batch(mode, own_step):
    # Built by its first batch, after `make_train_function` built the
    # metrics: UpdateRatio still compares with the weights from before the
    # first update (w = 3 -> 1.5: 1.5 / 3), and the per-layer keys are known.
    model = LateBuilt(own_step=own_step, name="net")
    history = fit(model, [kgm.UpdateRatio(), kgm.GradientNorm(per_layer=True)], compile_kwargs=mode)
    assert history["update_ratio"] == [0.5]
    assert history["grad_norm/net/dense_0"] == [15.0]


@pytest.mark.parametrize("own_step", [False, True], ids=STEP_IDS.get)
def test_per_layer_keys_of_a_model_built_by_its_first_batch_are_checked(mode, own_step):
    model = LateBuilt(own_step=own_step, name="net")
    metrics = [kgm.GradientNorm(per_layer=True), kgm.GradientNorm(per_layer=True, reduction="max")]
    with pytest.raises(ValueError, match="same name 'grad_norm/net/dense_0'"):
        fit(model, metrics, compile_kwargs=mode)
    assert keras.ops.convert_to_numpy(model.dense.kernel).tolist() == [
        [3.0]
    ]  # checked before the update


@pytest.mark.not_compiled_on_torch(
    reason="raised as test_a_gradient_metric_error_comes_before_anything_changes's are"
)
def test_a_metric_updated_before_the_update_raises_in_a_model_built_by_its_first_batch(mode):
    # Its trainable variables are read when the metric asks, not as the
    # step begins (before its forward pass built them).
    model = LateBuilt(own_step=True, metrics_first=True, name="net")
    with pytest.raises(ValueError, match="before any optimizer received gradients"):
        fit(model, [kgm.GradientNorm()], compile_kwargs=mode)


def test_alike_gradient_metrics_of_two_outputs_log_one_value():
    # Each output's list holds a `GradientNorm()`: both measure the total
    # loss's gradients, so they agree and log once.
    inputs = keras.Input((1,))
    model = kg.KeepGradModel(
        inputs, {"a": dense_0(name="a")(inputs), "b": dense_0(name="b", w=1.0)(inputs)}
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"a": "mse", "b": "mse"},
        metrics={"a": [kgm.GradientNorm()], "b": [kgm.GradientNorm()]},
    )
    history = model.fit(X, {"a": Y, "b": Y}, batch_size=2, verbose=0).history
    # Each head's gradient is its own 5w: sqrt(15^2 + 5^2).
    assert history["grad_norm"] == [pytest.approx(np.hypot(15.0, 5.0), rel=1e-6)]


def test_non_scalar_fn_names_the_metric():
    model = one_weight()
    metric = kgm.GradientMetric(lambda g: g["dense_0"]["kernel"], name="whole_kernel")
    with pytest.raises(ValueError, match=r"'whole_kernel' must return a scalar.*\(1, 1\)"):
        fit(model, [metric])


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
def whole_kernel(grads):
    return grads["dense_0"]["kernel"]  # shape (1, 1): not a scalar


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
def failing(grads):
    raise ZeroDivisionError("failing fn")


# `(model, metric, error, message)` of each error a gradient metric raises.
FAILING = {
    "keep_gradients=False": (
        lambda: one_weight(keep_gradients=False),
        kgm.GradientNorm,
        ValueError,
        r"'grad_norm'.*compiled into model 'functional.*keeps no gradients.*"
        r"`model.keep_gradients = True`.*Received: keep_gradients=False",
    ),
    "keeps_nothing": (
        lambda: one_weight(cls=UpdatesByHand),
        kgm.GradientNorm,
        ValueError,
        r"'grad_norm'.*before any optimizer received gradients.*keep_step_gradients",
    ),
    "non_scalar": (
        one_weight,
        lambda: kgm.GradientMetric(whole_kernel),
        ValueError,
        r"'whole_kernel' must return a scalar.*\(1, 1\)",
    ),
    "fn_raises": (one_weight, lambda: kgm.GradientMetric(failing), ZeroDivisionError, "failing fn"),
}


@pytest.mark.parametrize(
    "case",
    compiled_on_torch_only(
        FAILING, ["fn_raises"], reason="raised where the metric updates, as fn_raises"
    ),
)
def test_a_gradient_metric_error_comes_before_anything_changes(case, mode, tmp_path):
    make, metric, error, match = FAILING[case]
    model = make()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae", metric()], **mode
    )
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=2, verbose=0)
    # Not the 1.5 of an applied step (eager steps apply before the metrics).
    np.testing.assert_array_equal(model.get_weights()[0], [[W0]])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0
    assert [np.sum(np.abs(keras.ops.convert_to_numpy(v))) for v in model.metrics_variables] == [
        0.0
    ] * len(model.metrics_variables)
    model.save(tmp_path / "model.keras")
    assert keras.models.load_model(tmp_path / "model.keras").get_weights()[0][0, 0] == W0


EAGER = dict(run_eagerly=True)


def test_an_eager_step_that_fails_puts_update_ratios_copies_back():
    # UpdateRatio copies w (3 -> 1.5) before the failing metric raises: the
    # copy goes back with w, so the next step's ratio is |1.5 - 3| / 3.
    model = one_weight()
    ratio = kgm.UpdateRatio()
    with pytest.raises(ZeroDivisionError):
        fit(model, [ratio, kgm.GradientMetric(failing)], compile_kwargs=EAGER)
    assert fit(model, [ratio], compile_kwargs=EAGER)["update_ratio"] == [0.5]


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: kgm.GradientMetric(None), TypeError, "Received: fn=None"),
        (lambda: kgm.GradientMetric(3.0), TypeError, "Received: fn=3.0"),
        (
            lambda: kgm.GradientMetric(kernel_grad, reduction="median"),
            ValueError,
            "reduction='median'",
        ),
        (lambda: kgm.GradientNorm(per_layer="yes"), TypeError, "per_layer='yes'"),
        (lambda: kgm.VanishingGradients(threshold=-1.0), ValueError, "threshold=-1.0"),
        (
            lambda: kgm.VanishingGradients(threshold=float("nan")),
            ValueError,
            r"^`threshold` must be a finite, non-negative number\. Received: threshold=nan$",
        ),
        (lambda: kgm.VanishingGradients(threshold=float("inf")), ValueError, "threshold=inf"),
        (lambda: kgm.VanishingGradients(threshold=True), ValueError, "threshold=True"),
        (lambda: kgm.GradientNorm(dtype="float16"), ValueError, "dtype='float16'"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_vanishing_threshold_accepts_any_real_number():
    # NumPy numbers, as GradientMonitor's thresholds accept them; stored as
    # a Python float, so the config stays JSON-serializable.
    for threshold, expected in [(np.float32(0.5), 0.5), (np.int64(2), 2.0), (0, 0.0)]:
        metric = kgm.VanishingGradients(threshold=threshold)
        assert metric.threshold == expected
        assert type(metric.get_config()["threshold"]) is float


@pytest.mark.parametrize(
    "cls, expected",
    [
        (kgm.GradientNorm, "grad_norm"),
        (kgm.GradientMaxAbs, "grad_max_abs"),
        (kgm.NonFiniteGradients, "grad_nonfinite"),
        (kgm.VanishingGradients, "grad_vanishing"),
        (kgm.UpdateRatio, "update_ratio"),
    ],
)
def test_name_none_means_the_default_name(cls, expected):
    # As for Keras metrics (`keras.metrics.Mean(name=None).name == "mean"`).
    assert cls(name=None).name == expected
    assert cls.from_config({**cls().get_config(), "name": None}).name == expected


@pytest.mark.parametrize("name, error", [("", ValueError), (3, TypeError)])
def test_a_name_that_is_no_log_key_is_named(name, error):
    # Keras would turn "" into the class's snake-case name ("gradient_norm"),
    # not this metric's default log key.
    match = rf"`name` must be a non-empty string.*Received: name={name!r} of type"
    with pytest.raises(error, match=match):
        kgm.GradientNorm(name=name)
    with pytest.raises(error, match=match):
        kgm.GradientMetric(kernel_grad, name=name)
