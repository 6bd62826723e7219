"""Skipping a bad step's update on TensorFlow (`_skipping`): a `tf.cond`."""

import keras
import tensorflow as tf

__all__ = ["apply_if"]


def apply_if(run, apply, optimizer, variables):
    """Runs `apply()` (the optimizer's `apply`) where `run` is true.

    Graph and XLA steps trace the update into a branch of a `tf.cond`, so
    a skipped step runs none of its ops; an eager step runs the branch.
    """
    if not optimizer.built:
        # As `apply` builds it, but outside the branch: a `tf.cond` cannot
        # create the optimizer's variables.
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)

    def applied():
        apply()
        return tf.constant(True)

    tf.cond(run, applied, lambda: tf.constant(False))
