"""Skipping a bad step's update on TensorFlow (`_skipping`): guarded writes,
or a `tf.cond`; under a strategy of several replicas, each replica's
copies' writes (`replica_guards`).

Also the host side of a skipped step's evidence (`_evidence`): `call_if`,
and `replay_gradients`.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_keepgrad import _capture
from keras_keepgrad.backend.tensorflow import distribute
from keras_keepgrad.backend.tensorflow import replica_guards

__all__ = ["apply_if", "call_if", "deferring_host_calls", "host_cond", "replay_gradients"]

# The open `deferring_host_calls` blocks' lists (XLA steps being traced).
_deferred = []


def apply_if(run, apply, optimizer, variables, grads):
    """Runs `apply()` (the optimizer's `apply` of `grads`) where `run` is
    true.

    Where it can (`_guardable`), each write of the update is guarded as it
    happens (`_guarding_writes`); else the update is traced into a branch
    of a `tf.cond`, so a skipped step runs none of its ops. An eager step
    runs the branch. In a replica's step of a strategy with several
    replicas, each write to a replica's copy of a variable is guarded
    (`replica_guards.guarding_replica_writes`).
    """
    # Outside the branch: a `tf.cond` cannot create the optimizer's variables.
    _capture.build_as_apply(optimizer, variables)
    context = distribute.shared_context()
    if context is not None:
        written = replica_guards.replica_components(optimizer, variables)
        with replica_guards.guarding_replica_writes(run, written, context, optimizer):
            return apply()
    if not tf.executing_eagerly():
        guarded = _guardable(optimizer, variables, grads)
        if guarded is not None:
            step = _capture.current_step()
            select = step is not None and step.model.jit_compile
            with _guarding_writes(run, guarded, select):
                return apply()

    def applied():
        apply()
        return tf.constant(True)

    tf.cond(run, applied, lambda: tf.constant(False))


def _guardable(optimizer, variables, grads):
    """The `tf.Variable`s of `variables` and of `optimizer`'s state, if its
    update's writes can be guarded one by one (`_guarding_writes`); else
    None.

    Only Keras's own optimizers, which write nothing but their variables
    and those they update, through `assign`, `assign_add` and
    `assign_sub`, and dense gradients (a sparse one is written row by row,
    `scatter_*`) qualify; a `LossScaleOptimizer` branches itself.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    if not replica_guards.of_keras(optimizer):
        return None
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return None
    written = replica_guards.written_variables(optimizer, variables)
    for value in written:
        if not isinstance(value, tf.Variable) or isinstance(value, tf.distribute.DistributedValues):
            return None
    return written


@contextlib.contextmanager
def _guarding_writes(run, variables, select):
    """While open, each write to `variables` (`tf.Variable`s) happens only
    where `run` is true: a skipped update leaves every bit as it was; an
    applied one writes what it would have written.

    A branch around the whole update makes every op of it wait for the
    judgement, even those that read no gradient: it cost the 1M-parameter
    MLP's graph step about 2.5 points more than guarding each write
    (`benchmarks/`). Guarded one by one, only the writes wait: each in a
    `tf.cond` of its own. Under XLA
    (`select`), which turns a branch into a selection of each variable's
    new or old value after it (and an update that reads a moment it has
    updated, as Adam does, then copies every moment's old value, each
    step), each write selects `tf.where(run, new, old)` as it happens.
    """

    def guarding(variable):
        assign = variable.assign
        methods = (assign, variable.assign_add, variable.assign_sub)
        combines = (lambda old, value: value, tf.add, tf.subtract)

        def guard(method, combine):
            def write(value, use_locking=None, name=None, read_value=True):
                value = tf.convert_to_tensor(value, variable.dtype)
                if select:
                    old = variable.read_value()
                    return assign(tf.where(run, combine(old, value), old), read_value=read_value)

                def written():
                    method(value, read_value=False)
                    return tf.constant(True)

                tf.cond(run, written, lambda: tf.constant(False))
                return variable if read_value else None

            return write

        return [guard(m, c) for m, c in zip(methods, combines)]

    for variable in variables:
        variable.assign, variable.assign_add, variable.assign_sub = guarding(variable)
    try:
        yield
    finally:
        for variable in variables:
            del variable.assign, variable.assign_add, variable.assign_sub


@contextlib.contextmanager
def deferring_host_calls():
    """Collects the `call_if`s of an XLA step, which cannot call the host:
    the step returns their tensors and `host_cond` runs them after it.

    Yields:
        A list of `(flag, names, values, fn)`, filled as the step is traced.
    """
    calls = []
    _deferred.append(calls)
    try:
        yield calls
    finally:
        _deferred.pop()


def call_if(flag, fn, tensors, rows=()):
    """Runs `fn({name: np.ndarray})` on the host where `flag` is true.

    Eager: a Python `if`. Graph: a `tf.cond` around a `tf.numpy_function`,
    so the tensors leave the device only where `flag` holds. In an XLA step
    (`deferring_host_calls`) that `tf.cond` follows the XLA program.

    In a replica's step of a strategy with several replicas, `fn` runs
    once for all of them, where they meet (`merge_call`): the tensors
    named in `rows` (each replica's share of the batch) are gathered
    (`strategy.gather`) in replica order, which is the order in which the
    strategy split the batch; the others (the same on every replica) are
    replica 0's. With replicas in other worker processes
    (`MultiWorkerMirroredStrategy`) the gathering is a collective each
    worker's branch joins (`flag` is the same on all), and `fn` runs on
    the chief only (`strategy.extended.should_checkpoint`), as a
    checkpoint is written by the chief.
    """
    names = list(tensors)
    values = [tensors[n] for n in names]
    context = distribute.shared_context()
    if context is not None:

        def merged(strategy, flag, *values):
            local = strategy.experimental_local_results

            def joined():
                return [
                    strategy.gather(v, axis=0) if n in rows else local(v)[0]
                    for n, v in zip(names, values)
                ]

            chief = strategy.extended.should_checkpoint
            host_cond(local(flag)[0], names, joined, fn if chief else lambda arrays: None)

        context.merge_call(merged, args=(flag, *values))
        return
    if tf.executing_eagerly():
        if bool(flag):
            fn({n: np.asarray(v) for n, v in zip(names, values)})
        return
    if _deferred:
        _deferred[-1].append((flag, names, values, fn))
        return
    host_cond(flag, names, values, fn)


def host_cond(flag, names, values, fn):
    """The graph part of `call_if`. `values`: tensors, or a function that
    returns them, called in the branch."""

    def host(*arrays):
        fn(dict(zip(names, arrays)))
        return np.bool_(True)

    def run():
        tensors = values() if callable(values) else values
        return tf.reshape(tf.numpy_function(host, tensors, tf.bool, stateful=True), [])

    tf.cond(flag, run, lambda: tf.constant(False))


def replay_gradients(model, x, y, sample_weight, scale):
    """The gradients of `model`'s compiled loss on one batch, as its
    training step computes them (see `_evidence.replay_batch`)."""
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        loss = loss * tf.cast(scale, loss.dtype)
    grads = tape.gradient(loss, model.trainable_variables)
    return [None if g is None else tf.convert_to_tensor(g) / scale for g in grads]
