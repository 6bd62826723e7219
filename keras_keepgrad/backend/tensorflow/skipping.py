"""Skipping a bad step's update on TensorFlow (`_skipping`): a `tf.cond`.

Also the host side of a skipped step's evidence (`_evidence`): `call_if`,
and `replay_gradients`.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from keras_keepgrad import _capture

__all__ = ["apply_if", "call_if", "deferring_host_calls", "host_cond", "replay_gradients"]

# The open `deferring_host_calls` blocks' lists (XLA steps being traced).
_deferred = []


def apply_if(run, apply, optimizer, variables, grads):
    """Runs `apply()` (the optimizer's `apply` of `grads`) where `run` is
    true.

    Graph steps trace the update into a branch of a `tf.cond`, so a skipped
    step runs none of its ops; an eager step runs the branch. XLA steps
    select instead (`_selecting`), where they can.
    """
    # Outside the branch: a `tf.cond` cannot create the optimizer's variables.
    _capture.build_as_apply(optimizer, variables)
    step = _capture.current_step()
    if step is not None and step.model.jit_compile:
        selected = _selectable(optimizer, variables, grads)
        if selected is not None:
            with _selecting(run, selected):
                return apply()

    def applied():
        apply()
        return tf.constant(True)

    tf.cond(run, applied, lambda: tf.constant(False))


def _selectable(optimizer, variables, grads):
    """The `tf.Variable`s of `variables` and of `optimizer`'s state, if its
    update can be selected (`_selecting`); else None.

    XLA turns a `tf.cond` around the update into a selection of each
    variable's new or old value after it, and an update that reads a
    moment it has updated (Adam reads m and v) then copies every moment's
    old value, each step (its compiled program shows one copy per
    moment). An update whose every write is selected as it happens reads
    the selected values instead, and needs no copy. Only Keras's own
    optimizers, which write nothing but their variables and those they
    update, and dense gradients (a sparse one is written row by row,
    `scatter_*`) qualify; a `LossScaleOptimizer` branches itself.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    if not type(optimizer).__module__.startswith("keras."):
        return None
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return None
    selected = {}
    for variable in [*variables, *optimizer.variables]:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        if not isinstance(value, tf.Variable) or isinstance(value, tf.distribute.DistributedValues):
            return None
        selected[id(value)] = value
    return list(selected.values())


@contextlib.contextmanager
def _selecting(run, variables):
    """While open, each write to `variables` (`tf.Variable`s) writes the
    new value where `run` is true and the old one where it is false: a
    skipped update leaves every bit as it was; an applied one writes what
    it would have written."""

    def selecting(variable):
        assign = variable.assign

        def select(value, use_locking=None, name=None, read_value=True):
            value = tf.convert_to_tensor(value, variable.dtype)
            return assign(tf.where(run, value, variable.read_value()), read_value=read_value)

        def select_add(delta, use_locking=None, name=None, read_value=True):
            delta = tf.convert_to_tensor(delta, variable.dtype)
            return select(variable.read_value() + delta, read_value=read_value)

        def select_sub(delta, use_locking=None, name=None, read_value=True):
            delta = tf.convert_to_tensor(delta, variable.dtype)
            return select(variable.read_value() - delta, read_value=read_value)

        return select, select_add, select_sub

    for variable in variables:
        variable.assign, variable.assign_add, variable.assign_sub = selecting(variable)
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


def call_if(flag, fn, tensors):
    """Runs `fn({name: np.ndarray})` on the host where `flag` is true.

    Eager: a Python `if`. Graph: a `tf.cond` around a `tf.numpy_function`,
    so the tensors leave the device only where `flag` holds. In an XLA step
    (`deferring_host_calls`) that `tf.cond` follows the XLA program.
    """
    names = list(tensors)
    values = [tensors[n] for n in names]
    if tf.executing_eagerly():
        if bool(flag):
            fn({n: np.asarray(v) for n, v in zip(names, values)})
        return
    if _deferred:
        _deferred[-1].append((flag, names, values, fn))
        return
    host_cond(flag, names, values, fn)


def host_cond(flag, names, values, fn):
    """The graph part of `call_if`."""

    def host(*arrays):
        fn(dict(zip(names, arrays)))
        return np.bool_(True)

    def run():
        return tf.reshape(tf.numpy_function(host, values, tf.bool, stateful=True), [])

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
