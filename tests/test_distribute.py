"""Distributed training: the kept gradients are the global batch's.

Under `tf.distribute.MirroredStrategy` every replica runs `train_step` on its
share of the batch, with the loss scaled by `1 / num_replicas`: its gradient
is a partial sum. What `model.gradients`, gradient metrics and callbacks see
must be the sum, equal to what one device keeps for the same global batch.

TensorFlow fixes its devices when it first runs an op, so every scenario
runs in a subprocess that first splits the CPU into 2 logical devices
(`tf.config.set_logical_device_configuration`); `MultiWorkerMirroredStrategy`
runs as two worker processes on 127.0.0.1. The pytest process only reads
their JSON results. Every subprocess is bounded by a timeout.

The one-weight model of the suite: a bias-free Dense(1) with w = 3,
x = [[1], [2]], y = 0, mse: d/dw mean((w x)^2) = 5w = 15. On 2 replicas,
replica 0 gets x = 1 and keeps its partial 2w * 1 / 2 = 3, replica 1 gets
x = 2 and keeps 2w * 4 / 2 = 12: the sum is 15, and SGD(0.1) -> w = 1.5.
"""

import json
import os
import subprocess
import sys
import traceback
import warnings

import numpy as np
import pytest
from conftest import REPO
from conftest import computed_once
from conftest import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
# Every test here reads the results of a subprocess on 2 logical CPUs or of
# two worker processes; under `--dist loadgroup` (.ci/run) they run on one
# test worker, which makes each module fixture's subprocess once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distribute")]
TIMEOUT = 600
_MARK = "@@RESULT@@"

# What a subprocess runs first: TensorFlow's devices are fixed by the first
# op, so the logical CPUs are configured before anything else is imported.
_PRELUDE = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
if {devices} > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * {devices},
    )
sys.path[:0] = [{repo!r}, {here!r}]
import {module}
print({module}._MARK + json.dumps({module}.{entry}()), flush=True)
"""


def _python(entry, devices, env=None, module="test_distribute"):
    """A subprocess on `devices` logical CPUs that prints `module.entry()`."""
    code = _PRELUDE.format(devices=devices, repo=REPO, here=HERE, entry=entry, module=module)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(process, timeout=TIMEOUT):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"subprocess timed out after {timeout} s:\n{out[-2000:]}{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith(_MARK)]
    assert process.returncode == 0 and lines, out[-2000:] + err[-4000:]
    return json.loads(lines[-1][len(_MARK) :])


# Fixtures: each subprocess runs once per test session ----------------------


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    """The MirroredStrategy scenarios, run on 2 logical CPUs."""
    return computed_once(
        tmp_path_factory,
        "distribute_mirrored",
        lambda: _result(_python("_mirrored_scenarios", devices=2)),
    )


@pytest.fixture(scope="module")
def mirrored_metrics(tmp_path_factory):
    """Gradient metrics made outside the MirroredStrategy's scope, on 2 logical CPUs."""
    return computed_once(
        tmp_path_factory,
        "distribute_mirrored_metrics",
        lambda: _result(_python("_metrics_outside_scenarios", devices=2)),
    )


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Two `MultiWorkerMirroredStrategy` workers on 127.0.0.1, one CPU each."""
    return computed_once(
        tmp_path_factory, "distribute_workers", lambda: _workers("_worker_scenario")
    )


def _workers(entry, module="test_distribute"):
    """`[worker 0's result, worker 1's]` of `module.entry()` run by two
    `MultiWorkerMirroredStrategy` workers on 127.0.0.1, one CPU each."""
    hosts = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
        env = {"TF_CONFIG": json.dumps(tf_config)}
        processes.append(_python(entry, devices=1, env=env, module=module))
    try:
        return [_result(p) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _ok(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


# MirroredStrategy ---------------------------------------------------------


def test_fit_inside_the_scope_and_an_own_step_keep_the_global_gradient(mirrored):
    in_scope = _ok(mirrored, "fit_in_scope")
    assert in_scope["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
    assert in_scope["weight"] == 1.5
    assert in_scope["history"] == {"grad_norm": [15.0], "loss": [22.5]}
    # A user's own step: the replicas' partial 3 and 12 the optimizer sums.
    own = _ok(mirrored, "own_step")
    assert own["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
    assert own["weight"] == 1.5
    assert own["grad_norm"] == [15.0]


def test_one_weight_model_keeps_the_global_gradient(mirrored):
    r = _ok(mirrored, "one_weight")
    assert r["replicas"] == 2
    # Before step 1 nothing is kept, so reading raises.
    assert r["at_train_begin"].startswith("RuntimeError: ")
    assert "no kept gradients yet" in r["at_train_begin"]
    # What a callback sees after the step: 5w = 15, not a replica's 3 or 12.
    assert r["in_callback"] == [[[15.0]]]
    assert r["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
    assert r["weight"] == 1.5  # 3 - 0.1 * 15
    # Gradient metrics see the global value too; the loss is Keras's own.
    assert r["history"] == {"grad_norm": [15.0], "loss": [22.5]}
    # How it is stored: each replica wrote its own partial gradient, with no
    # communication in the step; reading sums them.
    assert r["replica_copies"] == [[[3.0]], [[12.0]]]
    # `train_on_batch` hands every replica the whole batch (1/2 of its loss
    # each); at w = 1.5 the kept gradient is 5 * 1.5.
    assert r["train_on_batch"] == [[7.5]]
    assert "loss" in r["evaluate"] and "grad_norm" not in r["evaluate"]


def test_a_metric_reads_the_sums_the_optimizer_all_reduced(mirrored):
    r = _ok(mirrored, "reduction_reuse")
    # Plain SGD all-reduces the kept partial gradients 3 and 12 as they
    # are: `GradientNorm` reads that sum, 15, with no all-reduce of its own.
    assert r["sgd"]["grad_norm"] == [15.0]
    assert r["sgd"]["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
    assert r["sgd"]["weight"] == 1.5
    assert r["sgd"]["all_reduces"] == []
    # With `clipnorm=1` Keras clips each replica's partial gradient to 1
    # before summing (w = 3 - 0.1 * 2): that sum is not the kept one, so
    # the metric all-reduces the kept gradient itself: one tensor, in each
    # replica's trace of the step (Keras traces it more than once).
    assert r["clipnorm"]["grad_norm"] == [15.0]
    assert r["clipnorm"]["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
    assert r["clipnorm"]["weight"] == pytest.approx(2.8, rel=1e-6)
    assert r["clipnorm"]["all_reduces"] and set(r["clipnorm"]["all_reduces"]) == {1}


def test_saved_gradients_restore_into_replica_slots(mirrored):
    r = _ok(mirrored, "save_gradients")
    # Saved after step 1 (15), trained on (w = 1.5 keeps 7.5), loaded back:
    # the weight and the kept gradient are step 1's again, and the value
    # is split over the replicas' copies so that reading sums to it.
    assert r["before_load"] == [[7.5]]
    assert r["after_load"] == [[15.0]]
    assert r["weight"] == 1.5
    assert r["replica_copies"] == [[[7.5]], [[7.5]]]


def test_steps_per_execution_fails_upstream_under_mirrored(mirrored):
    # Keras 3.15 on TensorFlow 2.21 cannot run `steps_per_execution > 1`
    # under MirroredStrategy at all (its `tf.while_loop` over the distributed
    # iterator feeds no value to a placeholder); KeepGradModel is the same.
    r = _ok(mirrored, "steps_per_execution")
    for error in (r["plain_keras_error"], r["keep_grad_model_error"]):
        assert error.startswith("InvalidArgumentError")
        assert "You must feed a value for placeholder" in error


def test_keep_every_counts_steps_on_every_replica(mirrored):
    r = _ok(mirrored, "keep_every")
    # Two steps with keep_every=2: only step 1 (w = 3, 5w = 15) is written;
    # step 2 (w = 1.5, 7.5) is not; the weight took both: 3 -> 1.5 -> 0.75.
    assert r["gradients"] == [[15.0]]
    assert r["weight"] == 0.75


@pytest.mark.parametrize("optimizer", ["sgd", "loss_scale"])
def test_equals_one_device_with_frozen_layer_and_embedding(mirrored, optimizer):
    r = _ok(mirrored, f"reference_{optimizer}")
    one, two = r["one_device"], r["mirrored"]
    assert r["replicas"] == 2
    # Frozen layers are absent, as in get_state_tree()["trainable_variables"].
    assert two["structure"] == two["state_tree"] == one["structure"]
    assert "frozen" not in two["structure"]
    assert len(two["steps"]) == len(one["steps"]) == 3
    for step_one, step_two in zip(one["steps"], two["steps"]):
        assert step_two.keys() == step_one.keys()
        for path in step_one:
            np.testing.assert_allclose(
                step_two[path], step_one[path], rtol=1e-5, atol=1e-7, err_msg=path
            )
    np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-5)
    for w_two, w_one in zip(two["weights"], one["weights"]):
        np.testing.assert_allclose(w_two, w_one, rtol=1e-5, atol=1e-7)
    # The embedding's rows are summed over replicas, repeated ids included
    # (id 0 is in both halves); each replica stores its rows sparse.
    assert two["embedding_storage"] == "sparse"


def test_mixed_float16_skips_consistently_and_matches_one_device(mirrored):
    r = _ok(mirrored, "mixed_float16")
    one, two, plain = r["one_device"], r["mirrored"], r["plain_keras_mirrored"]
    # One device, float16 (max 65504), w = 3, x = [[1], [2]]: the scaled
    # kernel gradient 15 * scale overflows until the scale is 4096
    # (61440). On 2 replicas, replica 0's partial 3 * scale fits from 16384
    # on, replica 1's 12 * scale only from 4096.
    assert one["scales"] == [32768.0, 16384.0, 8192.0, 4096.0]
    assert one["weights"] == [3.0, 3.0, 3.0, 1.5]
    inf = float("inf")
    assert one["kept"] == [inf, inf, inf, 15.0]
    # KeepGradModel skips a step when any replica overflows, as one device
    # does here: the same scales, weights and kept gradients (float32).
    assert two["scales"] == one["scales"]
    assert two["weights"] == one["weights"]
    assert two["kept"] == one["kept"]
    assert two["dtype"] == one["dtype"] == "float32"
    # The non-finite count aggregates over replicas: at scale 16384 replica
    # 0 alone is finite, and still the step counts, on every replica.
    assert two["grad_nonfinite"] == one["grad_nonfinite"] == [1.0, 2.0, 3.0, 3.0]
    assert two["epoch_grad_nonfinite"] == 3.0
    # Upstream Keras 3.15 decides from replica 0 alone: at scale 16384 it
    # applies replica 1's overflow and the weight is lost.
    assert plain["scales"][:2] == [32768.0, 16384.0]
    assert plain["weights"][0] == 3.0
    assert not np.isfinite(plain["weights"][1])


def test_keep_gradients_outside_the_scope_trains_under_the_models_strategy(mirrored):
    # The plain model was made in the strategy's scope, `keep_gradients` is
    # called outside it: the result takes the model's strategy (it failed
    # with "tuple indices must be integers or slices, not MirroredVariable").
    r = _ok(mirrored, "wrapped_outside")
    assert r["same_strategy"] is True
    assert r["gradients"] == [[15.0]]  # 5w at w = 3, the global batch
    assert r["weight"] == 1.5 and r["loss"] == [22.5]


def test_gradient_metrics_made_outside_the_scope_read_as_made_inside(mirrored_metrics):
    r = _ok(mirrored_metrics, "every_metric")
    inside, outside = r["inside"], r["outside"]
    # Two steps: w = 3 keeps 5w = 15, then w = 1.5 keeps 7.5 (w -> 0.75).
    assert inside["weight"] == outside["weight"] == 0.75
    # The same numbers, per batch and per epoch, wherever they were made
    # (made outside, the sums and per-layer values read 2x or 1/2x).
    np.testing.assert_equal(outside, inside)
    snr = 5 / (3 * 2**0.5)
    expected = {
        "loss": 14.0625,  # mean(22.5, 5.625)
        "mae": 3.375,  # mean(4.5, 2.25): Keras's own
        "grad_norm": 11.25,  # mean(15, 7.5)
        "norm_layer/dense_0": 11.25,
        "norm_sum": 22.5,
        "norm_layer_last/dense_0": 7.5,
        "grad_max_abs": 22.5,  # sum
        # Threshold 10: step 2's norm 7.5 is below it, step 1's 15 is not.
        "grad_vanishing": 1.0,  # sum
        # |w_after - w_before| / |w_before|: 1.5 / 3, then 0.75 / 1.5.
        "update_ratio/dense_0": 0.5,
        "ratio_sum": 1.0,
        # Each replica's batch (one example) is a small batch: its gradient
        # of mean((w x)^2) is 2w x^2, 2w and 8w; the big batch's is 5w.
        # |G|^2 ~ 2 * 25w^2 - mean(4w^2, 64w^2) = 16w^2 and
        # tr(Sigma) ~ 2 * (34w^2 - 25w^2) = 18w^2: B_simple = 18/16 a step.
        "grad_noise_scale": 2.25,  # sum
        "grad_noise_scale/trace_cov": 18 * (9 + 2.25),
        "grad_noise_scale/grad_sq": 16 * (9 + 2.25),
        # |mean| / std of (2w, 8w): 5w / sqrt(2 * (3w)^2), every step.
        "grad_snr/dense_0": snr,
        # Step 2's gradient has step 1's direction; step 1 has no previous.
        "grad_cosine/dense_0": 1.0,
        "cosine_sum": 1.0,
    }
    assert inside["epoch"].keys() == expected.keys()
    for key, value in expected.items():
        assert inside["epoch"][key] == pytest.approx(value, rel=1e-6), key
    # After step 1 (w = 3), as the progress bar shows them.
    first = inside["batches"][0]
    assert first["norm_layer/dense_0"] == first["norm_sum"] == 15.0
    assert first["update_ratio/dense_0"] == 0.5
    assert first["grad_snr/dense_0"] == pytest.approx(snr, rel=1e-6)
    assert np.isnan(first["grad_cosine/dense_0"])


def test_nonfinite_count_made_outside_the_scope(mirrored_metrics):
    # The mixed_float16 run of `test_mixed_float16_skips_consistently...`
    # with `NonFiniteGradients` made outside the scope: the same count of
    # skipped steps (the first three), not twice it.
    r = _ok(mirrored_metrics, "nonfinite")
    assert r["grad_nonfinite"] == [1.0, 2.0, 3.0, 3.0]
    assert r["epoch_grad_nonfinite"] == 3.0
    assert r["weights"] == [3.0, 3.0, 3.0, 1.5]


def test_jit_compile_falls_back_with_a_warning(mirrored):
    r = _ok(mirrored, "jit_compile")
    # Plain Keras cannot compile the distributed step with XLA at all.
    assert "Trying to access resource" in r["plain_keras_error"]
    assert len(r["warnings"]) == 1
    message = r["warnings"][0]
    assert "jit_compile=True" in message and "jit_compile=False" in message
    assert "MirroredStrategy" in message
    # It names the user's `compile` line, not a frame inside Keras or TF.
    assert r["warned_at"] == ["test_distribute.py"]
    assert r["jit_compile"] is False
    assert r["gradients"] == [[15.0]]


# MultiWorkerMirroredStrategy ---------------------------------------------


def test_multi_worker_fit_keeps_the_same_global_gradient(workers):
    for index, r in enumerate(workers):
        assert "error" not in r, r.get("error")
        assert r["task"] == index
        assert r["replicas"] == 2
        # Worker 0 trains on x = 1, worker 1 on x = 2: each keeps 15.
        assert r["local_x"] == [[float(index + 1)]]
        assert r["gradients"] == {"dense_0": {"kernel": [[15.0]]}}
        assert r["in_callback"] == [[[15.0]]]
        assert r["weight"] == 1.5
        assert r["history"] == {"grad_norm": [15.0], "loss": [22.5]}
        # Slots hold the all-reduced value: a read needs no other worker.
        assert r["replica_copies"] == [[[15.0]]]


def test_multi_worker_keeps_a_sparse_gradient(workers):
    for r in workers:
        assert "embedding_error" not in r, r.get("embedding_error")
        # Worker 0 has ids [1, 1, 3], worker 1 [0, 1, 4]; every output is 6,
        # d(loss)/d(output) = 6 per sample, 6 per occurrence of an id.
        assert r["embedding_gradients"] == [[6.0] * 2, [18.0] * 2, [0.0] * 2, [6.0] * 2, [6.0] * 2]


def test_plain_keras_fit_fails_under_multi_worker(workers):
    # Keras 3.15's `_maybe_symbolic_build` reduces a
    # pulled batch with `strategy.reduce`, which fails on the PerReplica;
    # past that, its scalar logs fail `reduce(..., axis=0)`.
    for r in workers:
        assert r["plain_keras_error"].startswith("ValueError")
        assert "PerReplica" in r["plain_keras_error"]
        assert r["plain_keras_logs_error"].startswith("ValueError")
        assert "Invalid reduction dimension 0" in r["plain_keras_logs_error"]


# What the subprocesses run ------------------------------------------------
#
# Everything below imports TensorFlow lazily: only the subprocesses call it,
# after `_PRELUDE` configured the devices.

X = [[1.0], [2.0]]
Y = [[0.0], [0.0]]


def _scenario(results, name, fn, *args):
    try:
        results[name] = fn(*args)
    except Exception:  # reported to pytest, which fails that test alone
        results[name] = {"error": traceback.format_exc()}


def _one_weight_model(
    cls, strategy, metrics=None, options=None, metrics_outside=False, **compile_kwargs
):
    """The suite's one-weight model, built and compiled under `strategy`.

    `metrics` names the `kg.metrics` classes to compile with, or is a
    function that returns the metrics. They are made in the scope (their
    variables are created with them), or before entering it with
    `metrics_outside=True`. By default a `KeepGradModel` gets `GradientNorm`.
    """
    import contextlib

    import keras

    import keras_keepgrad as kg

    if metrics is None:
        metrics = ["GradientNorm"] if issubclass(cls, kg.KeepGradModel) else []
    if not callable(metrics):
        names = metrics

        def metrics():
            return [getattr(kg.metrics, name)() for name in names]

    with contextlib.nullcontext() if metrics_outside else strategy.scope():
        metrics = metrics()
    with strategy.scope():
        inputs = keras.Input((1,))
        layer = keras.layers.Dense(
            1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
        )
        model = cls(inputs, layer(inputs), **(options or {}))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=metrics, **compile_kwargs
        )
    return model


def _dataset(x, y, batch_size, repeat=1):
    import tensorflow as tf

    x = np.asarray(x, "float32") if np.asarray(x).dtype.kind == "f" else np.asarray(x, "int32")
    ds = tf.data.Dataset.from_tensor_slices((x, np.asarray(y, "float32")))
    return ds.repeat(repeat).batch(batch_size)


def _fit(model, data, **kwargs):
    return model.fit(data, epochs=1, verbose=0, shuffle=False, **kwargs)


def _tolist(tree):
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: np.asarray(t).tolist(), tree)


def _recorder(read):
    """A callback that records `read(model)` at train begin and each batch."""
    import keras

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.begin, self.steps, self.logs = None, [], []

        def on_train_begin(self, logs=None):
            try:
                self.begin = read(self.model)
            except RuntimeError as error:
                self.begin = f"RuntimeError: {error}"

        def on_train_batch_end(self, batch, logs=None):
            self.steps.append(read(self.model))
            self.logs.append(dict(logs or {}))

    return Recorder()


def _kernel(model):
    return np.asarray(model.gradients["dense_0"]["kernel"]).tolist()


def _weight(model):
    return float(np.asarray(model.get_layer("dense_0").kernel)[0, 0])


def _copies(strategy, slot_variable):
    """This process's per-replica copies of a slot variable."""
    return [np.asarray(c).tolist() for c in strategy.experimental_local_results(slot_variable)]


def _scenario_one_weight(strategy):
    import keras_keepgrad as kg

    model = _one_weight_model(kg.KeepGradModel, strategy)
    recorder = _recorder(_kernel)
    history = _fit(model, _dataset(X, Y, batch_size=2), callbacks=[recorder])
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "at_train_begin": recorder.begin,
        "in_callback": recorder.steps,
        "gradients": _tolist(model.gradients),
        "weight": _weight(model),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "replica_copies": _copies(strategy, model._keeper._slots["dense_0/kernel"].values),
    }
    model.train_on_batch(np.asarray(X, "float32"), np.zeros((2, 1), "float32"))
    result["train_on_batch"] = _kernel(model)
    result["evaluate"] = model.evaluate(_dataset(X, Y, batch_size=2), verbose=0, return_dict=True)
    return result


def _scenario_save_gradients(strategy):
    import tempfile

    import keras_keepgrad as kg

    model = _one_weight_model(kg.KeepGradModel, strategy, options={"save_gradients": True})
    data = _dataset(X, Y, batch_size=2)
    _fit(model, data)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.weights.h5")
        model.save_weights(path)
        _fit(model, data)
        before = _kernel(model)
        model.load_weights(path)
    return {
        "before_load": before,
        "after_load": _kernel(model),
        "weight": _weight(model),
        "replica_copies": _copies(strategy, model._keeper._slots["dense_0/kernel"].values),
    }


def _scenario_steps_per_execution(strategy):
    import keras

    import keras_keepgrad as kg

    errors = {}
    models = {"plain_keras_error": keras.Model, "keep_grad_model_error": kg.KeepGradModel}
    for name, cls in models.items():
        model = _one_weight_model(cls, strategy, steps_per_execution=2)
        try:
            _fit(model, _dataset(X, Y, batch_size=2, repeat=2))
            errors[name] = ""
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def _scenario_keep_every(strategy):
    import keras_keepgrad as kg

    model = _one_weight_model(kg.KeepGradModel, strategy, options={"keep_every": 2})
    _fit(model, _dataset(X, Y, batch_size=2, repeat=2))
    return {"gradients": _kernel(model), "weight": _weight(model)}


# ids per row; batch 8 -> replica 0 gets rows 0-3, replica 1 rows 4-7, and
# id 0 is in both halves. Three steps of 8 rows.
_IDS = [[0, 1], [1, 2], [2, 3], [0, 0], [4, 5], [5, 0], [1, 1], [3, 4]] * 3
_TARGETS = [[0.5], [-1.0], [2.0], [0.0], [1.5], [-0.5], [1.0], [0.25]] * 3


def _reference_model(cls, strategy, optimizer):
    import keras

    import keras_keepgrad as kg

    with strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((2,), dtype="int32")
        h = keras.layers.Embedding(6, 3, name="embedding")(inputs)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(4, activation="tanh", name="hidden")(h)
        h = keras.layers.Dense(4, name="frozen", trainable=False)(h)
        outputs = keras.layers.Dense(1, name="out")(h)
        model = cls(inputs, outputs)
        sgd = keras.optimizers.SGD(0.05)
        if optimizer == "loss_scale":
            sgd = keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0**10)
        model.compile(optimizer=sgd, loss="mse", metrics=[kg.metrics.GradientNorm()])
    return model


def _train_reference(strategy, optimizer, weights=None):
    import keras_keepgrad as kg

    model = _reference_model(kg.KeepGradModel, strategy, optimizer)
    if weights is not None:
        model.set_weights(weights)
    recorder = _recorder(lambda m: _tolist(m.get_gradients_by_path()))
    weights = model.get_weights()
    _fit(model, _dataset(_IDS, _TARGETS, batch_size=8), callbacks=[recorder])
    storage = model._keeper._slots["embedding/embeddings"].spec[0]

    def keys(tree):
        return {k: keys(v) for k, v in tree.items()} if isinstance(tree, dict) else None

    return weights, {
        "structure": keys(model.gradients),
        "state_tree": keys(model.get_state_tree()["trainable_variables"]),
        "steps": recorder.steps,
        "grad_norm": [logs["grad_norm"] for logs in recorder.logs],
        "weights": [w.tolist() for w in model.get_weights()],
        "embedding_storage": storage,
    }


def _scenario_reference(strategy, optimizer):
    import tensorflow as tf

    with tf.device("/cpu:0"):
        weights, one = _train_reference(tf.distribute.get_strategy(), optimizer)
    _, two = _train_reference(strategy, optimizer, weights)
    return {"replicas": strategy.num_replicas_in_sync, "one_device": one, "mirrored": two}


def _mixed_run(cls, strategy, metrics_outside=False):
    import keras
    import tensorflow as tf

    kept = cls is not keras.Model
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _one_weight_model(
            cls,
            strategy,
            metrics=["NonFiniteGradients"] if kept else [],
            metrics_outside=metrics_outside,
        )
    finally:
        keras.config.set_dtype_policy("float32")

    class Track(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.scales, self.weights, self.kept, self.nonfinite = [], [], [], []

        def on_train_batch_begin(self, batch, logs=None):
            # The scale the step uses: before its first step (without a
            # strategy Keras builds the optimizer as it traces the step)
            # the initial one.
            optimizer = self.model.optimizer
            scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
            self.scales.append(float(np.asarray(scale)))

        def on_train_batch_end(self, batch, logs=None):
            self.weights.append(_weight(self.model))
            if kept:
                self.kept.append(_kernel(self.model)[0][0])
                self.nonfinite.append(float(logs["grad_nonfinite"]))

    track = Track()
    history = _fit(model, _dataset(X, Y, batch_size=2, repeat=4), callbacks=[track])
    out = {"scales": track.scales, "weights": track.weights}
    if kept:
        out.update(
            kept=track.kept,
            grad_nonfinite=track.nonfinite,
            epoch_grad_nonfinite=history.history["grad_nonfinite"][0],
            dtype=tf.as_dtype(model.gradient_dtypes["dense_0/kernel"]).name,
        )
    return out


def _scenario_mixed_float16(strategy):
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    with tf.device("/cpu:0"):
        one = _mixed_run(kg.KeepGradModel, tf.distribute.get_strategy())
    return {
        "one_device": one,
        "mirrored": _mixed_run(kg.KeepGradModel, strategy),
        "plain_keras_mirrored": _mixed_run(keras.Model, strategy),
    }


def _scenario_jit_compile(strategy):
    import keras

    import keras_keepgrad as kg

    plain = _one_weight_model(keras.Model, strategy, jit_compile=True)
    try:
        _fit(plain, _dataset(X, Y, batch_size=2))
        plain_error = ""
    except Exception as e:  # upstream: XLA reads replica 1's variable on CPU:0
        plain_error = f"{type(e).__name__}: {e}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _one_weight_model(kg.KeepGradModel, strategy, jit_compile=True)
    _fit(model, _dataset(X, Y, batch_size=2))
    return {
        "plain_keras_error": plain_error,
        "warnings": [str(w.message) for w in caught if "jit_compile" in str(w.message)],
        "warned_at": [
            os.path.basename(w.filename) for w in caught if "jit_compile" in str(w.message)
        ],
        "jit_compile": model.jit_compile,
        "gradients": _kernel(model),
    }


def _scenario_wrapped_outside_the_scope(strategy):
    import keras

    import keras_keepgrad as kg

    plain = _one_weight_model(keras.Model, strategy)  # made and compiled in it
    model = kg.keep_gradients(plain)  # outside the scope
    history = _fit(model, _dataset(X, Y, batch_size=2))
    return {
        "same_strategy": model.distribute_strategy is strategy,
        "gradients": _kernel(model),
        "weight": _weight(plain),
        "loss": history.history["loss"],
    }


def _every_gradient_metric():
    """Every gradient metric, global and per layer, in reductions that add
    up (sum, mean) and that pick (last)."""
    import keras_keepgrad as kg

    m = kg.metrics
    return [
        "mae",
        m.GradientNorm(),
        m.GradientNorm(per_layer=True, name="norm_layer"),
        m.GradientNorm(reduction="sum", name="norm_sum"),
        m.GradientNorm(per_layer=True, reduction="last", name="norm_layer_last"),
        m.GradientMaxAbs(reduction="sum"),
        m.VanishingGradients(threshold=10.0, reduction="sum"),
        m.UpdateRatio(per_layer=True),
        m.UpdateRatio(reduction="sum", name="ratio_sum"),
        m.GradientNoiseScale(smoothing=0.0, components=True, reduction="sum"),
        m.GradientSNR(),
        m.GradientCosine(per_layer=True),
        m.GradientCosine(reduction="sum", name="cosine_sum"),
    ]


def _scenario_every_metric(strategy):
    import keras_keepgrad as kg

    results = {}
    for where, outside in (("inside", False), ("outside", True)):
        model = _one_weight_model(
            kg.KeepGradModel, strategy, metrics=_every_gradient_metric, metrics_outside=outside
        )
        recorder = _recorder(lambda m: None)
        history = _fit(model, _dataset(X, Y, batch_size=2, repeat=2), callbacks=[recorder])
        results[where] = {
            "epoch": {k: float(v[0]) for k, v in history.history.items()},
            "batches": [{k: float(v) for k, v in logs.items()} for logs in recorder.logs],
            "weight": _weight(model),
        }
    return results


def _metrics_outside_scenarios():
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    keras.config.disable_traceback_filtering()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    _scenario(results, "every_metric", _scenario_every_metric, strategy)
    _scenario(results, "nonfinite", _mixed_run, kg.KeepGradModel, strategy, True)
    return results


def _mirrored_scenarios():
    import keras
    import tensorflow as tf

    keras.config.disable_traceback_filtering()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    _scenario(results, "one_weight", _scenario_one_weight, strategy)
    _scenario(results, "save_gradients", _scenario_save_gradients, strategy)
    _scenario(results, "steps_per_execution", _scenario_steps_per_execution, strategy)
    _scenario(results, "keep_every", _scenario_keep_every, strategy)
    _scenario(results, "reference_sgd", _scenario_reference, strategy, "sgd")
    _scenario(results, "reference_loss_scale", _scenario_reference, strategy, "loss_scale")
    _scenario(results, "mixed_float16", _scenario_mixed_float16, strategy)
    _scenario(results, "jit_compile", _scenario_jit_compile, strategy)
    _scenario(results, "wrapped_outside", _scenario_wrapped_outside_the_scope, strategy)
    _scenario(results, "fit_in_scope", _scenario_fit_in_scope, strategy)
    _scenario(results, "own_step", _scenario_own_step, strategy)
    _scenario(results, "reduction_reuse", _scenario_reduction_reuse, strategy)
    return results


def _scenario_reduction_reuse(strategy):
    """How often reading the global gradient all-reduces it in the step."""
    import keras

    import keras_keepgrad as kg
    from keras_keepgrad.backend.tensorflow import distribute

    original = distribute.all_reduce_sum
    calls = []

    def counting(grads):
        grads = list(grads)
        calls.append(len(grads))
        return original(grads)

    distribute.all_reduce_sum = counting
    results = {}
    try:
        for name, options in (("sgd", {}), ("clipnorm", {"clipnorm": 1.0})):
            calls.clear()
            model = _one_weight_model(kg.KeepGradModel, strategy)
            with strategy.scope():
                model.compile(
                    optimizer=keras.optimizers.SGD(0.1, **options),
                    loss="mse",
                    metrics=[kg.metrics.GradientNorm()],
                )
            history = _fit(model, _dataset(X, Y, batch_size=2))
            results[name] = {
                "grad_norm": [float(v) for v in history.history["grad_norm"]],
                "gradients": _tolist(model.gradients),
                "weight": _weight(model),
                "all_reduces": list(calls),
            }
    finally:
        distribute.all_reduce_sum = original
    return results


def _scenario_fit_in_scope(strategy):
    import keras_keepgrad as kg

    model = _one_weight_model(kg.KeepGradModel, strategy)
    with strategy.scope():
        history = _fit(model, _dataset(X, Y, batch_size=2))
    return {
        "gradients": _tolist(model.gradients),
        "weight": _weight(model),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    }


def _scenario_own_step(strategy):
    import tensorflow as tf

    import keras_keepgrad as kg

    class OwnStep(kg.KeepGradModel):
        # The guide's step: Keras's `compute_loss` scales each replica's
        # loss by 1 / replicas, as in Keras's own step.
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            variables = self.trainable_variables
            self.optimizer.apply(tape.gradient(loss, variables), variables)
            return self.compute_metrics(x, y, y_pred)

    model = _one_weight_model(OwnStep, strategy)
    history = _fit(model, _dataset(X, Y, batch_size=2))
    return {
        "gradients": _tolist(model.gradients),
        "weight": _weight(model),
        "grad_norm": [float(v) for v in history.history["grad_norm"]],
    }


def _worker_scenario():
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = _dataset(X, Y, batch_size=2).with_options(options)
    result = {"task": task, "replicas": strategy.num_replicas_in_sync}

    # Upstream, in the order a plain `fit` meets them.
    plain = _one_weight_model(keras.Model, strategy)
    try:
        _fit(plain, data)
        result["plain_keras_error"] = ""
    except ValueError as e:
        result["plain_keras_error"] = f"ValueError: {e}"

    class BuiltBySpec(keras.Model):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            with self.distribute_strategy.scope():
                self.build((None, 1))

    plain = _one_weight_model(BuiltBySpec, strategy)
    try:
        _fit(plain, data)
        result["plain_keras_logs_error"] = ""
    except ValueError as e:
        result["plain_keras_logs_error"] = f"ValueError: {e}"

    def local_x(ds):
        batch = next(iter(strategy.experimental_distribute_dataset(ds)))[0]
        return [np.asarray(t).tolist() for t in strategy.experimental_local_results(batch)]

    try:
        model = _one_weight_model(kg.KeepGradModel, strategy)
        recorder = _recorder(_kernel)
        history = _fit(model, data, callbacks=[recorder])
        result.update(
            local_x=local_x(data)[0],
            gradients=_tolist(model.gradients),
            in_callback=recorder.steps,
            weight=_weight(model),
            history={k: [float(v) for v in vs] for k, vs in history.history.items()},
            replica_copies=_copies(strategy, model._keeper._slots["dense_0/kernel"].values),
        )
    except Exception:
        result["error"] = traceback.format_exc()

    # A sparse gradient: the step's all-reduce gathers the workers' rows
    # into values of unknown row count (and, once, lost row shape).
    try:
        with strategy.scope():
            inputs = keras.Input((3,), dtype="int32")
            embed = keras.layers.Embedding(5, 2, embeddings_initializer="ones", name="emb")
            head = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="head")
            model = kg.KeepGradModel(inputs, head(keras.layers.Flatten()(embed(inputs))))
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        ids = _dataset([[1, 1, 3], [0, 1, 4]], [[0.0], [0.0]], batch_size=2)
        _fit(model, ids.with_options(options))
        result["embedding_gradients"] = _tolist(model.gradients["emb"]["embeddings"])
    except Exception:
        result["embedding_error"] = traceback.format_exc()
    return result
