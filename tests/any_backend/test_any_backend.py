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
from conftest import X
from conftest import Y
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
    norms = [
        float(tensor_util.make_ndarray(e.tensor_proto))
        for e in acc.Tensors("gradients/global_norm")
    ]
    assert norms == [15.0, 7.5, 3.75]
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
