"""Tests of the training-dynamics metrics on TensorFlow.

The hand cases and the closed form, the same on every backend, are in
`dynamics_cases.py` (derivations there); here they run on TensorFlow,
beside what is TensorFlow's own: a user's step without `y_pred`,
TensorBoard's charts, and `MirroredStrategy`, whose replicas are the small
batches.
"""

import json
import math
import os
import subprocess
import sys

import dynamics_cases as cases
import keras
import numpy as np
import pytest
from conftest import REPO
from conftest import compiled_on_torch_only
from conftest import one_weight
from dynamics_cases import TWO_INPUT_DATA
from dynamics_cases import assert_closed_form
from dynamics_cases import two_input_model

import keras_keepgrad as kg
from keras_keepgrad import metrics as kgm
from keras_keepgrad.metrics import compiled

HERE = os.path.dirname(os.path.abspath(__file__))

# --- serialization first ----------------------------------------------------


@pytest.mark.parametrize(
    "metric, arguments",
    list(zip(cases.all_metrics(), cases.ARGUMENTS)),
    ids=lambda m: f"{type(m).__name__}-{m.name}" if hasattr(m, "name") else "",
)
def test_config_round_trip(metric, arguments):
    cases.config_round_trip(metric, arguments)


def test_names_and_defaults():
    noise = kgm.GradientNoiseScale()
    assert (noise.name, noise.reduction, noise.accumulation_steps) == (
        "grad_noise_scale",
        "last",
        4,
    )
    assert (noise.smoothing, noise.components) == (0.9, False)
    snr = kgm.GradientSNR()
    assert (snr.name, snr.reduction, snr.per_layer, snr.accumulation_steps) == (
        "grad_snr",
        "mean",
        True,
        4,
    )
    cosine = kgm.GradientCosine()
    assert (cosine.name, cosine.reduction, cosine.per_layer) == ("grad_cosine", "mean", False)
    assert kgm.GradientNoiseScale(name=None).name == "grad_noise_scale"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: kgm.GradientNoiseScale(accumulation_steps=1), ValueError, "accumulation_steps=1"),
        (lambda: kgm.GradientSNR(accumulation_steps=2.0), ValueError, "accumulation_steps=2.0"),
        (lambda: kgm.GradientNoiseScale(smoothing=1.0), ValueError, "smoothing=1.0"),
        (lambda: kgm.GradientNoiseScale(smoothing=-0.1), ValueError, "smoothing=-0.1"),
        (lambda: kgm.GradientNoiseScale(components=1), TypeError, "components=1"),
        (lambda: kgm.GradientCosine(per_layer="yes"), TypeError, "per_layer='yes'"),
        (lambda: kgm.GradientNoiseScale(reduction="median"), ValueError, "reduction='median'"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


# --- hand-computed values, one device (dynamics_cases.py) -------------------


# The statistics share their update and result, which run eagerly under
# torch.compile: there the windowed and the validated cases run compiled.
COMPILED_ON_TORCH = (
    cases.noise_scale_and_snr_over_a_window_of_two_steps,
    cases.sum_and_last_survive_validation,
)


@pytest.mark.parametrize(
    "case",
    compiled_on_torch_only(
        cases.MODE_CASES,
        COMPILED_ON_TORCH,
        reason="the statistics' update and result: the cases in COMPILED_ON_TORCH",
        ids=lambda case: case.__name__,
    ),
)
def test_hand_case_in_every_mode(case, mode):
    case(mode)


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.__name__)
def test_hand_case(case):
    case()


class StepWithoutBatch(kg.KeepGradModel):
    """A user's own step that updates `watched` metrics without `y_pred`.

    They are not compiled in: their state is made in the first step.
    """

    watched = ()

    def train_step(self, data):
        x, y = data
        variables = self.trainable_variables
        if keras.backend.backend() == "torch":
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            loss.backward()
            grads = [v.value.grad for v in variables]
            loss = loss.detach()
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, variables)
        self.optimizer.apply(grads, variables)
        for metric in self.watched:
            metric.update_state()
        return {"loss": loss}


NOT_ON_JAX = pytest.mark.backends(
    "tensorflow",
    "torch",
    reason="metrics outside the model, whose state a pure JAX step cannot carry",
)


@NOT_ON_JAX
def test_noise_scale_without_y_pred_names_the_fix():
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="dense_0")
    model = StepWithoutBatch(inputs, dense(inputs))
    model.watched = [kgm.GradientNoiseScale()]
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((2, 1), "float32")
    with pytest.raises(ValueError, match=r"first axis of `y_pred`.*compute_metrics"):
        model.fit(x, np.zeros_like(x), batch_size=1, verbose=0)
    # Raised before the update (SGD(0.01) would make w 1 - 0.01 * 2), or
    # with it put back: w = 1 still.
    assert float(np.asarray(model.weights[0])[0, 0]) == 1.0


@NOT_ON_JAX
def test_snr_and_cosine_need_no_batch_size():
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
    )
    model = StepWithoutBatch(inputs, dense(inputs))
    metrics = [kgm.GradientSNR(accumulation_steps=2), kgm.GradientCosine()]
    model.watched = metrics
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(np.array([[1.0], [2.0]], "float32"), np.zeros((2, 1)), batch_size=1, verbose=0)
    snr, cosine = metrics
    assert float(snr.result()["grad_snr/dense_0"]) == pytest.approx(5 / (3 * math.sqrt(2)), 1e-6)
    assert float(cosine.result()["grad_cosine"]) == 1.0


def test_state_stays_out_of_the_weights_and_the_saved_files(tmp_path):
    cases.state_stays_out_of_the_weights_and_the_saved_files(tmp_path)


def test_tensorboard_panel_lists_the_dynamics_charts(tmp_path):
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    metrics = [
        kgm.GradientNoiseScale(accumulation_steps=2, components=True),
        kgm.GradientCosine(),
    ]
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=metrics)
    assert compiled.tensorboard_charts(model) == [
        ("Gradient noise scale (B_simple)", ["^(epoch|batch)_grad_noise_scale$"]),
        (
            "Gradient noise scale: tr(Sigma) and |G|^2",
            ["^(epoch|batch)_grad_noise_scale/(trace_cov|grad_sq)$"],
        ),
        ("Cosine of successive gradients", ["^(epoch|batch)_grad_cosine(/.*)?$"]),
    ]
    log_dir = str(tmp_path / "logs")
    x = np.array([[1.0], [2.0]], "float32")
    model.fit(
        x,
        np.zeros_like(x),
        batch_size=1,
        verbose=0,
        callbacks=[kg.callbacks.GradientTensorBoard(log_dir)],
    )
    acc = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(event.tensor_proto).item())
    assert [c.title for c in layout.category] == ["Gradient panels", "Training dynamics"]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[1].chart}
    assert charts["Gradient noise scale (B_simple)"] == ["^(epoch|batch)_grad_noise_scale$"]
    # The charted tags exist: Keras's TensorBoard writes the logs.
    (value,) = acc.Tensors("epoch_grad_noise_scale")
    assert float(tf.make_ndarray(value.tensor_proto)) == 1.125
    assert "epoch_grad_cosine" in acc.Tags()["tensors"]


@pytest.mark.slow
def test_noise_scale_matches_the_closed_form_on_one_device():
    cases.noise_scale_matches_the_closed_form_on_one_device()


# --- MirroredStrategy on 2 logical CPUs, in a subprocess -------------------

_MARK = "@@RESULT@@"
_PRELUDE = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
sys.path[:0] = [{repo!r}, {here!r}]
import test_dynamics
print(test_dynamics._MARK + json.dumps(test_dynamics._mirrored_scenarios()), flush=True)
"""


def _mirrored_scenarios():
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {"replicas": strategy.num_replicas_in_sync}
    # The one-weight model, batch (1, 2): replica 0 gets x = 1, replica 1
    # x = 2; their partial gradients 3 and 12 are 6 / 2 and 24 / 2.
    with strategy.scope():
        metrics = [
            kgm.GradientNoiseScale(smoothing=0.0, components=True),
            kgm.GradientSNR(),
            kgm.GradientCosine(),
        ]
        model = one_weight()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=metrics)
    x = np.array([[1.0], [2.0]], "float32")
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(2)
    history = model.fit(data, epochs=1, verbose=0).history
    results["one_weight"] = {k: [float(v) for v in vs] for k, vs in history.items()}
    # The two-input model, each example twice: both replicas see the same
    # example, the global gradient is that example's.
    with strategy.scope():
        model = two_input_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss="mse",
            metrics=[kgm.GradientCosine(per_layer=True, name="cos")],
        )
    rows = np.repeat(TWO_INPUT_DATA, 2, axis=0)
    data = tf.data.Dataset.from_tensor_slices(((rows[:, :1], rows[:, 1:2]), rows[:, 2:])).batch(2)
    history = model.fit(data, epochs=1, verbose=0).history
    results["cosine"] = {k: [float(v) for v in vs] for k, vs in history.items()}
    results["regression"] = _mirrored_regression(strategy, steps=1500, batch=32)
    return results


def _mirrored_regression(strategy, steps, batch):
    """The closed form's estimate with each global batch split among the replicas."""
    import tensorflow as tf

    x, y, w = cases.regression_data(steps, batch)
    with strategy.scope():
        model = cases.regression_model(w, [cases.noise_scale_metric()])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    return cases.estimate(model.fit(data, epochs=1, verbose=0, shuffle=False).history)


# The tests that read `mirrored`, on one test worker under `--dist
# loadgroup` (.ci/run), which then runs its subprocess once.
MIRRORED_GROUP = pytest.mark.xdist_group("dynamics_mirrored")


@pytest.fixture(scope="module")
def mirrored():
    code = _PRELUDE.format(repo=REPO, here=HERE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    process = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in process.stdout.splitlines() if line.startswith(_MARK)]
    assert process.returncode == 0 and lines, process.stdout[-2000:] + process.stderr[-4000:]
    return json.loads(lines[-1][len(_MARK) :])


@pytest.mark.backends("tensorflow", reason="tf.distribute.MirroredStrategy")
@pytest.mark.slow
@MIRRORED_GROUP
def test_mirrored_replicas_are_the_small_batches(mirrored):
    assert mirrored["replicas"] == 2
    history = mirrored["one_weight"]
    # One step is one estimate: no accumulation window.
    assert history["grad_noise_scale/grad_sq"] == [144.0]
    assert history["grad_noise_scale/trace_cov"] == [162.0]
    assert history["grad_noise_scale"] == [1.125]
    assert history["grad_snr/dense_0"] == [pytest.approx(5 / (3 * math.sqrt(2)), rel=1e-6)]
    # Cosine needs a previous step: the one step of this epoch has none.
    assert math.isnan(history["grad_cosine"][0])


@pytest.mark.backends("tensorflow", reason="tf.distribute.MirroredStrategy")
@pytest.mark.slow
@MIRRORED_GROUP
def test_mirrored_cosine_is_of_the_global_gradients(mirrored):
    history = mirrored["cosine"]
    assert history["cos/a"] == [pytest.approx(-1.0, rel=1e-6)]
    assert history["cos/b"] == [pytest.approx(1 / 3, rel=1e-6)]


@pytest.mark.backends("tensorflow", reason="tf.distribute.MirroredStrategy")
@pytest.mark.slow
@MIRRORED_GROUP
def test_mirrored_noise_scale_matches_the_closed_form(mirrored):
    assert_closed_form(mirrored["regression"])
