"""`tf.distribute` support for the TensorFlow keeper.

Under `tf.distribute`, `train_step` runs once per replica, on that
replica's share of the global batch, and Keras scales each replica's loss
by `1 / num_replicas`: a replica's gradient is its partial sum, and the
global-batch gradient (what one device computes) is the sum over replicas.
The optimizer all-reduces its own, possibly clipped, copy later.
"""

import functools

import keras
import tensorflow as tf

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad.backend.tensorflow.slots import map_values

__all__ = [
    "agree_on_skip",
    "all_reduce_sum",
    "global_gradients",
    "install_reduction_reuse",
    "local_replica",
    "none_for_none_spec",
    "reduces_in_step",
    "replica_spec",
    "shared_context",
    "with_batch_axis",
]


def shared_context():
    """The replica context of a step whose batch several replicas share
    (inside `strategy.run`), else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def local_replica(context):
    """The index of `context`'s replica among this process's replicas: its
    place in `strategy.experimental_local_results`. Replicas in other
    worker processes come before or after this worker's in the sync
    group, as many per worker."""
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    return replica % len(context.strategy.extended.worker_devices)


def all_reduce_sum(grads):
    """Sums per-replica gradients over the replicas (identity on one).

    Must run in a replica context (inside `strategy.run`, e.g. in
    `train_step`). `tf.IndexedSlices` are gathered, rows concatenated.
    """
    context = shared_context()
    grads = list(grads)
    if context is None or not grads:
        return grads
    return list(context.all_reduce(tf.distribute.ReduceOp.SUM, grads))


def global_gradients(step, kept, passed):
    """`kept` (one `apply`'s kept partial gradients, which the update
    receives as `passed`) all-reduced in a replica's step of a strategy,
    to judge the step by: the same on every replica. Else `kept`, which
    then are the global gradients.

    Where the update receives a kept gradient as it is (in the step's
    `backend_state.passed`), that is what is summed, and the update's own
    all-reduce then reuses the sum (`_reusing_reductions`, which finds it
    in `backend_state.presummed`): one all-reduce per step, as without
    the judgement. Where the step all-reduced the kept gradients already
    (`reduces_in_step`), they are `kept`.
    """
    state = step.backend_state
    if shared_context() is None or reduces_in_step(step.keeper.strategy):
        return kept
    presummed = vars(state).setdefault("presummed", {})
    sources = [p if id(p) in state.passed else k for k, p in zip(kept, passed)]
    present = [i for i, g in enumerate(sources) if g is not None]
    summed = list(kept)
    for i, total in zip(present, all_reduce_sum([sources[i] for i in present])):
        summed[i] = total
        if id(sources[i]) in state.passed:
            # Matched by identity, as `state.passed`: held until the step ends.
            presummed[id(sources[i])] = (sources[i], total)
    return summed


def _reusing_reductions(all_reduce_sum_gradients):
    """Wraps an optimizer's `_all_reduce_sum_gradients`: in a training step
    of a `KeepGradModel`, each reduced gradient that is a kept partial
    gradient, as the update received it (no clipping, no loss-scale
    division, no accumulation in between), serves reads of the step's
    global gradients (`current_step_gradients`), which would otherwise
    all-reduce the same tensors a second time."""

    @functools.wraps(all_reduce_sum_gradients)
    def reusing(optimizer, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        step = _capture.current_step()
        state = getattr(step, "backend_state", None)
        presummed = getattr(state, "presummed", None)
        if presummed and all(
            g is None or presummed.get(id(g), (None,))[0] is g for g, _ in grads_and_vars
        ):
            # Summed already, to judge the step (`global_gradients`).
            result = [(None if g is None else presummed[id(g)][1], v) for g, v in grads_and_vars]
        else:
            result = all_reduce_sum_gradients(optimizer, grads_and_vars)
        passed = getattr(state, "passed", None)
        if passed:
            for (grad, _), (summed, _) in zip(grads_and_vars, result):
                entry = passed.get(id(grad))
                if entry is not None and entry[0] is grad and summed is not None:
                    state.summed_by_update[entry[1]] = summed
        return result

    reusing._keepgrad_reusing = True
    return reusing


def install_reduction_reuse():
    """Wraps TensorFlow optimizers' all-reduce once (`_reusing_reductions`)."""
    optimizer_class = _compat.tf_optimizer_class()
    method = optimizer_class._all_reduce_sum_gradients
    if not getattr(method, "_keepgrad_reusing", False):
        optimizer_class._all_reduce_sum_gradients = _reusing_reductions(method)


def reduces_in_step(strategy):
    """Whether slots hold all-reduced gradients rather than partial ones.

    A replica's partial gradient can be summed when read only if all the
    replicas live in this process. With replicas in other worker processes
    (`MultiWorkerMirroredStrategy` across machines) that read would be a
    collective every worker must join, so the step itself all-reduces and
    every replica keeps the global gradient.
    """
    if strategy.num_replicas_in_sync == 1:
        return False
    return len(strategy.extended.worker_devices) < strategy.num_replicas_in_sync


def replica_spec(spec):
    """One replica's batch spec, from a (possibly distributed) dataset's.

    A distributed dataset's `element_spec` holds a `PerReplicaSpec` per
    tensor (TensorFlow 2.21, no public accessor); every replica's batch has
    the structure and dtypes of the first, which is all the slots and the
    model's symbolic build need.
    """
    if spec is None:
        return None

    def one_replica(s):
        value_specs = getattr(s, "_value_specs", None)
        return value_specs[0] if value_specs else s

    return tf.nest.map_structure(one_replica, spec)


def none_for_none_spec(spec):
    """None for the spec of an absent (optional, None) input, else `spec`.

    What a symbolic build takes for such an input, as Keras's step turns a
    `tf.experimental.Optional` without a value into None.
    """
    if isinstance(spec, tf.OptionalSpec) or not hasattr(spec, "shape"):
        return None
    return spec


def agree_on_skip(optimizer, grads):
    """Makes the replicas agree on a `LossScaleOptimizer` skip.

    Keras 3.15's `LossScaleOptimizer._tf_apply` decides, under a strategy
    that uses `merge_call` (`MirroredStrategy`), whether to skip the step
    from replica 0's gradients alone, before they are all-reduced: an
    overflow on another replica only is applied, and every weight turns
    non-finite. Without `merge_call` each replica decides alone. Here the
    replicas first count their non-finite gradients together (a one-scalar
    all-reduce); if any replica has one, every replica hands the optimizer
    NaN gradients, so the step is skipped and the scale halved, as on one
    device. Finite steps pass through untouched. The kept gradients are
    stored before this, so they still show the real non-finite values.
    """
    context = shared_context()
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or context is None:
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    overflowed = tf.cast(tf.logical_not(optimizer.check_finite(present)), tf.float32)
    finite = tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed), 0.0)

    def nan(t):
        return tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype))

    present = iter(tf.cond(finite, lambda: present, lambda: [map_values(g, nan) for g in present]))
    return [None if g is None else next(present) for g in grads]


def with_batch_axis(step_function):
    """Wraps a step function so that each output gets a leading axis of 1.

    Under `MultiWorkerMirroredStrategy`, Keras 3.15 averages the replicas'
    step outputs with `strategy.reduce("MEAN", value, axis=0)`, which fails on
    scalars (the loss, the metrics; tensorflow/tensorflow#72388). With the
    axis, each replica contributes one row and the mean over the rows is the
    scalar mean over replicas that `MirroredStrategy` logs.
    """

    def step(data):
        return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), step_function(data))

    return step
