"""`model.first_bad_replica`: the first replica whose share went bad.

The one-weight model of the suite: a bias-free Dense(1) with w = 3, y = 0,
mse. Under `MirroredStrategy` on 2 logical CPUs a global batch x = [[p],
[q]] splits in order: replica 0 gets p, replica 1 gets q. A NaN in q
reaches only replica 1's partial gradient 2w q^2 / 2, a NaN in p only
replica 0's; the global gradient (their sum) is NaN either way.

TensorFlow fixes its devices when it first runs an op, so the strategy's
scenarios run in a subprocess that first splits the CPU into 2 logical
devices, as in `test_distribute.py`; the pytest process reads their JSON.
"""

import json
import os
import subprocess
import sys
import traceback

import keras
import numpy as np
import pytest
from conftest import REPO
from conftest import X
from conftest import Y
from conftest import computed_once
from conftest import one_weight

import keras_keepgrad as kg

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 600
_MARK = "@@RESULT@@"
_PRELUDE = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)
sys.path[:0] = [{repo!r}, {here!r}]
import test_replicas
print(test_replicas._MARK + json.dumps(test_replicas._mirrored_scenarios()), flush=True)
"""


# One replica --------------------------------------------------------------


def test_one_replica_names_replica_0_on_a_nonfinite_step(mode):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    model.train_on_batch(X, Y)
    assert model.first_bad_replica is None
    model.train_on_batch(np.array([[1.0], [np.nan]], "float32"), Y)
    assert model.first_bad_replica == 0


def test_first_bad_replica_raises_as_gradients_do():
    model = one_weight()
    with pytest.raises(RuntimeError, match=r"no kept gradients yet"):
        model.first_bad_replica  # noqa: B018
    with pytest.raises(AttributeError, match=r"keep_gradients=True"):
        one_weight(keep_gradients=False).first_bad_replica  # noqa: B018


# MirroredStrategy on 2 logical CPUs ------------------------------------------


# The tests that read `mirrored`, on one test worker under `--dist
# loadgroup` (.ci/run), which then makes it once.
MIRRORED_GROUP = pytest.mark.xdist_group("replicas_mirrored")


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    return computed_once(tmp_path_factory, "replicas_mirrored", _mirrored)


def _mirrored():
    code = _PRELUDE.format(repo=REPO, here=HERE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"subprocess timed out after {TIMEOUT} s:\n{out[-2000:]}{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith(_MARK)]
    assert process.returncode == 0 and lines, out[-2000:] + err[-4000:]
    return json.loads(lines[-1][len(_MARK) :])


def _ok(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.slow
@MIRRORED_GROUP
def test_names_the_replica_whose_share_holds_the_nan(mirrored):
    r = _ok(mirrored, "named")
    assert r["replicas"] == 2
    # Clean (1, 2): partials 3 and 12, no replica bad.
    assert r["clean"] == {"first": None, "gradient": [[15.0]]}
    # (1, NaN): replica 1's partial only; (NaN, 2): replica 0's; both: 0.
    assert r["nan_on_1"] == {"first": 1, "gradient": ["nan"]}
    assert r["nan_on_0"] == {"first": 0, "gradient": ["nan"]}
    assert r["nan_on_both"] == {"first": 0, "gradient": ["nan"]}
    # An infinity on replica 1: its partial is inf, the sum too.
    assert r["inf_on_1"] == {"first": 1, "gradient": ["inf"]}


@pytest.mark.slow
@MIRRORED_GROUP
def test_the_record_is_no_weight_and_follows_the_kept_step(mirrored):
    r = _ok(mirrored, "kept_step")
    # Not in the weights, nor in the saved weights file (as the slots):
    # the same arrays as a plain Keras model's.
    assert r["in_weights"] is False
    assert r["same_file_as_plain"] is True
    # keep_every=2: step 1 (clean) is written, step 2 (NaN on replica 1)
    # is not, so the kept gradients and the record stay step 1's (15,
    # None); step 3 is written: its weight went NaN at step 2, so both.
    assert r["steps"] == [[[[15.0]], None], [[[15.0]], None], [["nan"], 0]]


@pytest.mark.slow
@MIRRORED_GROUP
def test_the_monitor_names_the_first_bad_replica(mirrored):
    r = _ok(mirrored, "monitor")
    assert r["messages"] == [
        "Step 1: non-finite gradients (NaN or inf) in 1 of 1 layers, in forward "
        "order: 'dense_0', first on replica 1 of 2."
    ]


# What the subprocess runs ----------------------------------------------------


def _scenario(results, name, fn, *args):
    try:
        results[name] = fn(*args)
    except Exception:  # reported to pytest, which fails that test alone
        results[name] = {"error": traceback.format_exc()}


def _model(strategy, **options):
    with strategy.scope():
        model = one_weight(**options)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _dataset(rows):
    import tensorflow as tf

    x = np.asarray(rows, "float32")
    return tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(2)


def _json(array):
    array = np.asarray(array)
    if np.all(np.isfinite(array)):
        return array.tolist()
    return sorted({str(v) for v in array.ravel()})


def _scenario_named(strategy):
    batches = {
        "clean": [[1.0], [2.0]],
        "nan_on_1": [[1.0], [np.nan]],
        "nan_on_0": [[np.nan], [2.0]],
        "nan_on_both": [[np.nan], [np.nan]],
        "inf_on_1": [[1.0], [np.inf]],
    }
    result = {"replicas": strategy.num_replicas_in_sync}
    for name, rows in batches.items():
        model = _model(strategy)
        model.fit(_dataset(rows), verbose=0)
        result[name] = {
            "first": model.first_bad_replica,
            "gradient": _json(model.gradients["dense_0"]["kernel"]),
        }
    return result


def _scenario_kept_step(strategy, directory):
    model = _model(strategy, keep_every=2)
    steps = []
    for rows in ([[1.0], [2.0]], [[1.0], [np.nan]], [[1.0], [2.0]]):
        model.fit(_dataset(rows), verbose=0)
        steps.append([_json(model.gradients["dense_0"]["kernel"]), model.first_bad_replica])
    plain = _model(strategy, cls=keras.Model)
    plain.fit(_dataset([[1.0], [2.0]]), verbose=0)
    record = model._keeper.bad_replicas.variable
    return {
        "steps": steps,
        "in_weights": any(v is record for v in model.weights),
        "same_file_as_plain": _saved_arrays(model, directory) == _saved_arrays(plain, directory),
    }


def _saved_arrays(model, directory):
    """The names of the arrays in `model`'s `.weights.h5` file."""
    import h5py

    path = os.path.join(directory, f"{model.name}.weights.h5")
    model.save_weights(path)
    names = []
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: names.append(name) if hasattr(obj, "shape") else None)
    return names


def _scenario_monitor(strategy):
    model = _model(strategy)
    monitor = kg.callbacks.GradientMonitor()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(_dataset([[1.0], [np.nan]]), verbose=0, callbacks=[monitor])
    return {"messages": [event["message"] for event in monitor.events]}


def _mirrored_scenarios():
    import tempfile

    import tensorflow as tf

    keras.config.disable_traceback_filtering()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    _scenario(results, "named", _scenario_named, strategy)
    with tempfile.TemporaryDirectory() as directory:
        _scenario(results, "kept_step", _scenario_kept_step, strategy, directory)
    _scenario(results, "monitor", _scenario_monitor, strategy)
    return results
