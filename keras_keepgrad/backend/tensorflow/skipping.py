"""Skipping a bad step's update on TensorFlow (`_skipping`): a `tf.cond`.

Also the host side of a skipped step's evidence (`_evidence`): `call_if`,
and `replay_gradients`.
"""

import contextlib

import numpy as np
import tensorflow as tf

from keras_keepgrad import _capture

__all__ = ["apply_if", "call_if", "deferring_host_calls", "host_cond", "replay_gradients"]

# The open `deferring_host_calls` blocks' lists (XLA steps being traced).
_deferred = []


def apply_if(run, apply, optimizer, variables):
    """Runs `apply()` (the optimizer's `apply`) where `run` is true.

    Graph and XLA steps trace the update into a branch of a `tf.cond`, so
    a skipped step runs none of its ops; an eager step runs the branch.
    """
    # Outside the branch: a `tf.cond` cannot create the optimizer's variables.
    _capture.build_as_apply(optimizer, variables)

    def applied():
        apply()
        return tf.constant(True)

    tf.cond(run, applied, lambda: tf.constant(False))


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
