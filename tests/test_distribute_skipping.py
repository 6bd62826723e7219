"""`skip_bad_steps` under `tf.distribute.MirroredStrategy` on 2 logical
CPUs, and under `MultiWorkerMirroredStrategy` with two workers.

Every replica judges the global gradient (the sum of the replicas'
partial gradients), so they all skip or all apply, on what one device
would see. The scenarios run in a subprocess that first splits the CPU
into 2 logical devices, and again in two worker processes on 127.0.0.1
of one replica each (see `test_distribute.py`); the pytest process reads
their JSON.

The one-weight model of the suite: a bias-free Dense(1) with w = 3, y = 0,
mse. On 2 replicas a batch x = [p, q] splits in order: replica 0 keeps the
partial gradient w p^2 (its loss is scaled by 1/2), replica 1 w q^2, and
the global gradient is w (p^2 + q^2). Learning rates are powers of 2, so
every weight below is exact in float32. Every variable read below is read
on each replica's copy: a value where all copies hold the same bits.
"""

import numpy as np
import pytest
import test_distribute
from conftest import computed_once
from test_distribute import _MARK  # noqa: F401  (the subprocess prints with it)
from test_distribute import _fit
from test_distribute import _ok
from test_distribute import _python
from test_distribute import _result
from test_distribute import _scenario
from test_distribute import _workers

# On one test worker under `--dist loadgroup`: test_distribute.py says why.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distribute_skipping")]


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    """The scenarios under `MirroredStrategy` on 2 logical CPUs."""
    return computed_once(
        tmp_path_factory,
        "distribute_skipping_mirrored",
        lambda: _result(
            _python("_skipping_scenarios", devices=2, module="test_distribute_skipping")
        ),
    )


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The scenarios under `MultiWorkerMirroredStrategy`: two worker
    processes of one CPU each, `[worker 0's results, worker 1's]`."""
    return computed_once(
        tmp_path_factory,
        "distribute_skipping_workers",
        lambda: _workers("_worker_skipping_scenarios", module="test_distribute_skipping"),
    )


@pytest.fixture(params=["mirrored", "worker 0", "worker 1"])
def skipping(request):
    """The results of one strategy's replicas: under `MirroredStrategy`
    both in one process, under `MultiWorkerMirroredStrategy` one per
    worker. Each worker reads its own copies, which must agree with the
    other's."""
    if request.param == "mirrored":
        return request.getfixturevalue("mirrored")
    return request.getfixturevalue("workers")[int(request.param[-1])]


def test_replicas_skip_a_nan_and_a_spike_of_the_global_gradient(skipping):
    r = _ok(skipping, "nan_and_spike")
    # Step 1, x = [1, 2]: global 3 * 5 = 15, applied: w = 3 - 15 / 8.
    # Step 2, x = [1, NaN]: replica 1's partial is NaN, skipped.
    # Step 3, x = [1, 1]: global 1.125 * 2 = 2.25 < 2 * 15, applied:
    # w = 1.125 - 2.25 / 8. Step 4, x = [2, 2]: global 0.84375 * 8 = 6.75
    # > 2 * 2.25 (window 1), skipped, although each replica's partial,
    # 3.375, is below 4.5: the replicas judge the sum.
    assert r["weights"] == [1.125, 1.125, 0.84375, 0.84375]
    assert r["iterations"] == [1, 1, 2, 2]
    assert r["skipped_steps"] == [0.0, 1.0, 1.0, 2.0]
    assert r["first_bad_replica"] == [None, 1, None, None]
    assert r["gradients"] == [[[15.0]], ["nan"], [[2.25]], [[6.75]]]
    # Counted once, not once per replica, when read between steps.
    assert r["metric_result"] == 2.0


def test_a_sum_of_finite_partials_that_overflows_is_skipped(skipping):
    r = _ok(skipping, "overflow")
    # x = [1e19, 1e19]: each replica's partial 3 * 1e38 is finite, their
    # sum 6e38 is beyond float32: skipped, though no replica went bad.
    assert r["weights"] == [3.0]
    assert r["skipped_steps"] == [1.0]
    assert r["gradients"] == [["inf"]]
    assert r["first_bad_replica"] == [None]


@pytest.mark.parametrize("results", ["mirrored", "worker 0"])
def test_the_saved_batch_is_the_global_batch_and_replays(results, request):
    # Under `MultiWorkerMirroredStrategy` the chief (worker 0) saves
    # every worker's rows.
    if results == "mirrored":
        r = _ok(request.getfixturevalue("mirrored"), "nan_and_spike")
    else:
        r = _ok(request.getfixturevalue("workers")[0], "nan_and_spike")
    assert r["files"] == ["bad_step_00000002.npz", "bad_step_00000004.npz"]
    nan, spike = r["saved"]
    # Both replicas' rows, in the order the strategy split them; the
    # global gradient; the replica whose partial went bad (-1: none).
    assert nan == {
        "x": ["1.0", "nan"],
        "y": [[0.0], [0.0]],
        "step": 2.0,
        "grad/dense_0/kernel": ["nan"],
        "skipped": True,
        "first_bad_replica": 1,
    }
    assert spike == {
        "x": [[2.0], [2.0]],
        "y": [[0.0], [0.0]],
        "step": 4.0,
        "grad/dense_0/kernel": [[6.75]],
        "skipped": True,
        "first_bad_replica": -1,
    }
    # Step 4 was skipped, so the weights are still those it saw.
    assert r["replayed_spike"] == [[6.75]]


def test_adam_skips_bit_identical_to_plain_keras_on_the_good_batches(skipping):
    r = _ok(skipping, "adam_as_plain")
    assert r["skipped_steps"] == {"adam": [1.0], "adamw_ema": [1.0]}
    # Weights, moments and iteration count: plain Keras's, to the bit.
    # Also AdamW with weight decay and EMA, which write beyond the update.
    assert r["same_bits"] == {"adam": True, "adamw_ema": True}
    assert r["iterations"] == {"adam": 2, "adamw_ema": 2}


def test_a_sparse_gradient_is_skipped_row_for_row(skipping):
    r = _ok(skipping, "embedding")
    # Rows 0 and 1 of Embedding(3, 1), all ones; y = [0, NaN] makes
    # replica 1's partial NaN: nothing moves. Then y = [0, 0]: each row's
    # gradient is e_i = 1 (mean of 2 rows of (e - y)^2), SGD(0.5) -> 0.5.
    assert r["after_nan"] == [[1.0], [1.0], [1.0]]
    assert r["after_good"] == [[0.5], [0.5], [1.0]]
    assert r["iterations"] == [0, 1]
    assert r["skipped_steps"] == [1.0, 0.0]


def test_under_loss_scaling_the_optimizer_halves_its_scale_and_a_spike_is_skipped(skipping):
    r = _ok(skipping, "loss_scale")
    # Step 1 applied, w = 1.125 (the counter counts it); step 2 (NaN) is
    # skipped by the optimizer, which halves its scale and resets the
    # counter; step 3, x = [4, 4]: 1.125 * 32 = 36 > 2 * 15 (the NaN step
    # joined no norm), a spike the guard skips (each partial, 18, is
    # not one): the counter does not count it.
    assert r["weights"] == [1.125, 1.125, 1.125]
    assert r["scale"] == [32768.0, 16384.0, 16384.0]
    assert r["counter"] == [1, 0, 0]
    assert r["skipped_steps"] == [0.0, 1.0, 2.0]


def test_only_the_chief_worker_saves(workers):
    # Worker 1 joined the gathering of the rows, and wrote nothing.
    r = _ok(workers[1], "nan_and_spike")
    assert r["files"] == []
    assert r["skipped_steps"] == [0.0, 1.0, 1.0, 2.0]


def test_skipping_adds_no_all_reduce_of_the_gradients(mirrored):
    r = _ok(mirrored, "all_reduces")
    # Each replica's trace all-reduces the one gradient once, skipping or
    # not: the optimizer's update reuses the sum the judgement took.
    # (Sizes of the tensors of each all-reduce: [1], the one weight's.)
    assert len(r["plain"]) >= 2 and r["plain"] == r["skipping"] == [[1]] * len(r["plain"])
    # Saving the batch adds one all-reduce of the replicas' flags (2
    # floats) per replica's trace, and nothing else.
    assert sorted(r["saving"]) == sorted(r["skipping"] + [[2]] * len(r["skipping"]))


def test_an_own_step_is_guarded(skipping):
    r = _ok(skipping, "own_step")
    assert r["weights"] == [1.125, 1.125]
    assert r["skipped_steps"] == [0.0, 1.0]


def test_an_optimizer_that_overrides_more_than_its_update_is_refused(skipping):
    r = _ok(skipping, "own_optimizer")
    assert "Keras's own optimizers and of subclasses that override only" in r["message"]
    assert "OwnSGD from 'test_distribute_skipping'" in r["message"]
    assert "which overrides `apply`. Override only" in r["message"]
    assert r["weight"] == 3.0
    assert r["iterations"] == 0


def test_an_optimizer_with_its_own_update_step_skips(skipping):
    r = _ok(skipping, "own_update_step")
    # Step 1, x = [1, 2]: gradient 15, w = 3 - 0.125 * sign(15), and the
    # optimizer's own variable sums it. Step 2 (NaN on replica 1) moves
    # neither. Step 3, x = [1, 1]: gradient 2.875 * 2 = 5.75.
    assert r["weights"] == [2.875, 2.875, 2.75]
    assert r["totals"] == [15.0, 15.0, 20.75]
    assert r["iterations"] == [1, 1, 2]
    assert r["skipped_steps"] == [0.0, 1.0, 1.0]


def test_nothing_stays_guarded_after_a_fit_or_a_step_that_raised(skipping):
    r = _ok(skipping, "cleanup")
    # A learning rate schedule that raises inside the optimizer's update,
    # while every replica's writes are guarded.
    assert "schedule raised" in r["message"]
    assert r["after_raise"] == {"guards": 0, "patched": []}
    # The same model trains on with a good schedule, and leaves nothing.
    assert r["weight"] == 1.125
    assert r["after_fit"] == {"guards": 0, "patched": []}


# What the subprocess runs ----------------------------------------------------


def _dataset(x, y, batch_size):
    """Batches of `(x, y)` that a `MultiWorkerMirroredStrategy` splits
    among its workers row by row, in order, as `MirroredStrategy` splits
    them among its replicas (`AutoShardPolicy.DATA`)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return test_distribute._dataset(x, y, batch_size).with_options(options)


def _json(array):
    array = np.asarray(array)
    if np.all(np.isfinite(array)):
        return array.tolist()
    return [str(v) for v in array.ravel()]


def _value(strategy, variable):
    """`variable`'s value where every replica's copy holds the same bits,
    else what each copy holds."""
    value = getattr(variable, "value", variable)
    copies = [np.asarray(c) for c in strategy.experimental_local_results(value)]
    if any(c.tobytes() != copies[0].tobytes() for c in copies):
        return {"copies differ": [c.tolist() for c in copies]}
    return copies[0].tolist()


def _weight(strategy, model):
    value = _value(strategy, model.get_layer("dense_0").kernel)
    return value[0][0] if isinstance(value, list) else value


def _iterations(strategy, model):
    return _value(strategy, model.optimizer.iterations)


def _model(strategy, optimizer, cls=None, **options):
    import keras

    import keras_keepgrad as kg

    cls = cls or kg.KeepGradModel
    with strategy.scope():
        inputs = keras.Input((1,))
        layer = keras.layers.Dense(
            1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
        )
        model = cls(inputs, layer(inputs), **options)
        model.compile(optimizer=optimizer(), loss="mse")
    return model


def _steps(strategy, model, batches):
    """Fits one batch at a time; records what each step left."""
    record = {k: [] for k in ("weights", "iterations", "skipped_steps", "gradients")}
    record["first_bad_replica"] = []
    for rows in batches:
        rows = np.asarray(rows, "float32").reshape(-1, 1)
        history = _fit(model, _dataset(rows, np.zeros_like(rows), batch_size=len(rows)))
        record["weights"].append(_weight(strategy, model))
        record["iterations"].append(_iterations(strategy, model))
        record["skipped_steps"].append(float(history.history["skipped_steps"][0]))
        record["gradients"].append(_json(model.gradients["dense_0"]["kernel"]))
        record["first_bad_replica"].append(model.first_bad_replica)
    return record


def _fit_recording(model, x, **reads):
    """Fits `x` (y = 0) in one epoch of batches of 2; after each batch,
    records each of `reads` (`{name: function of no argument}`) and the
    logged `skipped_steps`."""
    import keras

    record = {name: [] for name in [*reads, "skipped_steps"]}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            for name, read in reads.items():
                record[name].append(read())
            record["skipped_steps"].append(float(logs["skipped_steps"]))

    x = np.asarray(x, "float32").reshape(-1, 1)
    _fit(model, _dataset(x, np.zeros_like(x), batch_size=2), callbacks=[Record()])
    return record


def _scenario_nan_and_spike(strategy, directory):
    import os

    import keras

    import keras_keepgrad as kg

    config = kg.SkipBadSteps(spike_factor=2.0, window=1, save_batches_to=directory)
    model = _model(strategy, lambda: keras.optimizers.SGD(0.125), skip_bad_steps=config)
    # One epoch of 4 batches, then the same steps one at a time would
    # reset the count: fit all 4 in one `fit`, reading after each batch.
    result = _fit_recording(
        model,
        [1.0, 2.0, 1.0, np.nan, 1.0, 1.0, 2.0, 2.0],
        weights=lambda: _weight(strategy, model),
        iterations=lambda: _iterations(strategy, model),
        gradients=lambda: _json(model.gradients["dense_0"]["kernel"]),
        first_bad_replica=lambda: model.first_bad_replica,
    )
    result["metric_result"] = float(np.asarray(model._skipped_metric.result()["skipped_steps"]))
    result["files"] = sorted(os.listdir(directory))
    result["saved"] = []
    for name in result["files"]:
        with np.load(os.path.join(directory, name)) as f:
            result["saved"].append({k: _saved(f[k]) for k in f.files})
    if result["files"]:
        replayed = kg.replay_batch(model, os.path.join(directory, result["files"][-1]))
        result["replayed_spike"] = _json(replayed["dense_0/kernel"])
    return result


def _scenario_overflow(strategy):
    import keras

    model = _model(strategy, lambda: keras.optimizers.SGD(0.125), skip_bad_steps=True)
    return _steps(strategy, model, [[1e19, 1e19]])


def _saved(array):
    if array.ndim == 0:
        return array.item()
    return _json(array)


def _scenario_adam_as_plain(strategy, plain_cls=None):
    """`plain_cls`: the model that does not skip, by default `keras.Model`."""
    import keras

    optimizers = {
        "adam": lambda: keras.optimizers.Adam(0.125),
        "adamw_ema": lambda: keras.optimizers.AdamW(0.125, weight_decay=0.5, use_ema=True),
    }
    good = [1.0, 2.0, 2.0, 1.0]
    result = {"skipped_steps": {}, "same_bits": {}, "iterations": {}}
    for name, optimizer in optimizers.items():
        model = _model(strategy, optimizer, skip_bad_steps=True)
        plain = _model(strategy, optimizer, cls=plain_cls or keras.Model)
        x = np.asarray([*good[:2], 1.0, np.nan, *good[2:]], "float32").reshape(-1, 1)
        history = _fit(model, _dataset(x, np.zeros_like(x), batch_size=2))
        x = np.asarray(good, "float32").reshape(-1, 1)
        _fit(plain, _dataset(x, np.zeros_like(x), batch_size=2))

        def bits(m):
            variables = [*m.weights, *m.optimizer.variables]
            return [_value(strategy, v) for v in variables], [
                c.tobytes()
                for v in variables
                for c in map(np.asarray, strategy.experimental_local_results(v.value))
            ]

        result["skipped_steps"][name] = [float(v) for v in history.history["skipped_steps"]]
        result["same_bits"][name] = bits(model) == bits(plain)
        result["iterations"][name] = _iterations(strategy, model)
    return result


def _scenario_embedding(strategy):
    import keras

    import keras_keepgrad as kg

    with strategy.scope():
        inputs = keras.Input((1,), dtype="int32")
        table = keras.layers.Embedding(3, 1, embeddings_initializer="ones", name="table")
        outputs = keras.layers.Flatten()(table(inputs))
        model = kg.KeepGradModel(inputs, outputs, skip_bad_steps=True)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    result = {"iterations": [], "skipped_steps": []}
    ids = np.array([[0], [1]], "int32")
    for name, y in (("after_nan", [[0.0], [np.nan]]), ("after_good", [[0.0], [0.0]])):
        history = _fit(model, _dataset(ids, y, batch_size=2))
        result[name] = _value(strategy, table.embeddings)
        result["iterations"].append(_iterations(strategy, model))
        result["skipped_steps"].append(float(history.history["skipped_steps"][0]))
    return result


def _scenario_loss_scale(strategy):
    import keras

    import keras_keepgrad as kg

    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.125))

    config = kg.SkipBadSteps(spike_factor=2.0, window=1)
    model = _model(strategy, optimizer, skip_bad_steps=config)
    return _fit_recording(
        model,
        [1.0, 2.0, 1.0, np.nan, 4.0, 4.0],
        weights=lambda: _weight(strategy, model),
        scale=lambda: _value(strategy, model.optimizer.dynamic_scale),
        counter=lambda: _value(strategy, model.optimizer.step_counter),
    )


def _scenario_all_reduces(strategy, directory):
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    original = tf.distribute.ReplicaContext.all_reduce
    calls = []

    def counting(self, reduce_op, value, options=None):
        calls.append([int(np.prod(t.shape)) for t in tf.nest.flatten(value)])
        return original(self, reduce_op, value, options)

    tf.distribute.ReplicaContext.all_reduce = counting
    result = {}
    try:
        x = np.asarray([1.0, 2.0], "float32").reshape(-1, 1)
        for name, skip in (
            ("plain", None),
            ("skipping", True),
            ("saving", kg.SkipBadSteps(save_batches_to=directory)),
        ):
            calls.clear()
            model = _model(strategy, lambda: keras.optimizers.SGD(0.125), skip_bad_steps=skip)
            _fit(model, _dataset(x, np.zeros_like(x), batch_size=2))
            result[name] = list(calls)
    finally:
        tf.distribute.ReplicaContext.all_reduce = original
    result["skipping_gradients"] = [len(c) for c in result["skipping"]]
    result["saving_extra"] = [c for c in result["saving"] if c not in result["skipping"]]
    return result


def _scenario_own_step(strategy):
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    class OwnStep(kg.KeepGradModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    model = _model(strategy, lambda: keras.optimizers.SGD(0.125), cls=OwnStep, skip_bad_steps=True)
    record = _steps(strategy, model, [[1.0, 2.0], [1.0, np.nan]])
    return {"weights": record["weights"], "skipped_steps": record["skipped_steps"]}


def _fit_error(model):
    """The message of the ValueError that fitting x = [1, 2] raises."""
    x = np.asarray([1.0, 2.0], "float32").reshape(-1, 1)
    try:
        _fit(model, _dataset(x, np.zeros_like(x), batch_size=2))
    except ValueError as e:
        return str(e)
    return "no error"


def _scenario_own_optimizer(strategy):
    import keras

    class OwnSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            return super().apply(grads, trainable_variables)

    model = _model(strategy, lambda: OwnSGD(0.125), skip_bad_steps=True)
    return {
        "message": _fit_error(model),
        "weight": _weight(strategy, model),
        "iterations": _iterations(strategy, model),
    }


def _scenario_own_update_step(strategy):
    """An optimizer written as Keras's guide writes one: its own variables
    and `update_step` (a sign step that also sums the gradients)."""
    import keras
    from keras import ops

    class SignSGD(keras.optimizers.Optimizer):
        def build(self, variables):
            if self.built:
                return
            super().build(variables)
            self.totals = [self.add_variable_from_reference(v, "total") for v in variables]

        def update_step(self, gradient, variable, learning_rate):
            self.assign_add(self.totals[self._get_variable_index(variable)], gradient)
            self.assign_sub(variable, ops.multiply(learning_rate, ops.sign(gradient)))

    model = _model(strategy, lambda: SignSGD(0.125), skip_bad_steps=True)
    return _fit_recording(
        model,
        [1.0, 2.0, 1.0, np.nan, 1.0, 1.0],
        weights=lambda: _weight(strategy, model),
        totals=lambda: _value(strategy, model.optimizer.totals[0])[0][0],
        iterations=lambda: _iterations(strategy, model),
    )


def _scenario_cleanup(strategy):
    import keras

    from keras_keepgrad.backend.tensorflow import replica_guards

    class Schedule(keras.optimizers.schedules.LearningRateSchedule):
        fails = True

        def __call__(self, step):
            if self.fails:
                raise ValueError("schedule raised")
            return 0.125

    schedule = Schedule()
    model = _model(strategy, lambda: keras.optimizers.SGD(schedule), skip_bad_steps=True)

    def left():
        variables = [*model.weights, *model.optimizer.variables]
        copies = [c for v in variables for c in strategy.experimental_local_results(v.value)]
        patched = sorted(
            {n for c in copies for n in replica_guards._GUARDED_METHODS if n in vars(c)}
            | {n for n in vars(model.optimizer) if n == "_distributed_tf_update_step"}
        )
        return {"guards": len(replica_guards._replica_guards), "patched": patched}

    result = {"message": _fit_error(model), "after_raise": left()}
    schedule.fails = False
    x = np.asarray([1.0, 2.0], "float32").reshape(-1, 1)
    _fit(model, _dataset(x, np.zeros_like(x), batch_size=2))
    result.update(weight=_weight(strategy, model), after_fit=left())
    return result


def _skipping_scenarios():
    import keras
    import tensorflow as tf

    keras.config.disable_traceback_filtering()
    return _all_scenarios(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))


def _worker_skipping_scenarios():
    import keras
    import tensorflow as tf

    import keras_keepgrad as kg

    keras.config.disable_traceback_filtering()
    # Keras 3.15's own `fit` fails under this strategy (see
    # `test_distribute.py`): the reference is a `KeepGradModel` that does
    # not skip. Each worker saves to its own directory: the chief's alone
    # receives files.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return _all_scenarios(strategy, plain_cls=kg.KeepGradModel, count_all_reduces=False)


def _all_scenarios(strategy, plain_cls=None, count_all_reduces=True):
    import functools
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as directory:
        _scenario(results, "nan_and_spike", _scenario_nan_and_spike, strategy, directory)
    _scenario(results, "overflow", _scenario_overflow, strategy)
    plain = functools.partial(_scenario_adam_as_plain, plain_cls=plain_cls)
    _scenario(results, "adam_as_plain", plain, strategy)
    _scenario(results, "embedding", _scenario_embedding, strategy)
    _scenario(results, "loss_scale", _scenario_loss_scale, strategy)
    if count_all_reduces:
        with tempfile.TemporaryDirectory() as directory:
            _scenario(results, "all_reduces", _scenario_all_reduces, strategy, directory)
    _scenario(results, "own_step", _scenario_own_step, strategy)
    _scenario(results, "own_optimizer", _scenario_own_optimizer, strategy)
    _scenario(results, "own_update_step", _scenario_own_update_step, strategy)
    _scenario(results, "cleanup", _scenario_cleanup, strategy)
    return results
