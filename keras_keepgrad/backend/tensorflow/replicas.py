"""Which replicas' partial gradients were not finite, under `tf.distribute`.

Each replica of a `MirroredStrategy` step keeps its partial gradient (its
share of the global batch) before any all-reduce mixes them: that is where
a NaN or an infinity can be traced to one replica's share. Each replica
notes whether its own kept gradients of the step hold one, and writes that
flag into its own copy of an `ON_READ` variable, with no communication
(the slots are written the same way); `model.first_bad_replica` reads the
copies between steps. Where the step all-reduces the gradients itself
(replicas in other worker processes, `reduces_in_step`), the flags are
all-reduced with them, one float per replica, so that every worker reads
them all.

The variable is held by the keeper, as the slots are: never in
`model.weights`, checkpoints or saved files.
"""

import numpy as np
import tensorflow as tf

from keras_keepgrad import _squares
from keras_keepgrad.backend.tensorflow import distribute
from keras_keepgrad.backend.tensorflow.slots import densify
from keras_keepgrad.backend.tensorflow.slots import on_read

__all__ = ["BadReplicas", "nonfinite"]


def nonfinite(grads):
    """Bool scalar tensor: whether any of `grads` holds a NaN or an infinity.

    The float32 sums of squares first (one fused pass per gradient, no
    conditional on a good step); only where one is not finite, which a
    finite gradient above ~1.8e19 also gives, are the entries checked.
    """
    present = [g for g in grads if g is not None]
    if not present:
        return tf.constant(False)
    squares = _squares.sum_squares(present, exact=False)

    def entries():
        return tf.logical_not(
            tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(densify(g))) for g in present]))
        )

    return tf.cond(tf.reduce_all(tf.math.is_finite(squares)), lambda: tf.constant(False), entries)


def _own_flag(context, bad):
    """float32 `[num_replicas]`: `bad` at this replica's index, else 0."""
    count = context.num_replicas_in_sync
    return tf.one_hot(context.replica_id_in_sync_group, count) * tf.cast(bad, tf.float32)


class BadReplicas:
    """Records, per training step, which replicas' kept gradients were bad.

    Args:
        strategy: The model's `tf.distribute` strategy.

    Attributes:
        variable: float32 `tf.Variable` `[num_replicas]`, `ON_READ`, or None
            before a step with several replicas was traced. Each replica's
            copy holds 1.0 at its own index where its partial gradients were
            not finite (all-reduced: at every bad replica's index).
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.variable = None

    def note(self, state, grads):
        """In a replica's step, before any all-reduce: ORs whether `grads`
        (this replica's kept partial gradients) are bad into `state`."""
        if distribute.shared_context() is None:
            return
        bad = nonfinite(grads)
        previous = getattr(state, "replica_bad", None)
        state.replica_bad = bad if previous is None else tf.logical_or(previous, bad)

    def write(self, state, reduced, write_now=None):
        """At the end of a replica's step: writes the step's flags.

        Args:
            state: The step's backend state, as `note` left it.
            reduced: Bool. Whether the step all-reduces its gradients
                (`reduces_in_step`): the flags are then all-reduced too.
            write_now: None, or a bool tensor: whether the slots are
                written this step (`keep_every > 1`); the flags describe
                the step the slots hold.
        """
        bad = getattr(state, "replica_bad", None)
        context = tf.distribute.get_replica_context()
        if bad is None or context is None:
            return
        count = context.num_replicas_in_sync
        flags = _own_flag(context, bad)
        if reduced:
            flags = context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
        if self.variable is None:
            context.merge_call(lambda _: self._create(count))
        if write_now is not None:
            flags = tf.where(write_now, flags, self.variable.read_value())
        self.variable.assign(flags, read_value=False)

    def all_flags(self, state):
        """In a replica's step: bool tensor `[num_replicas]`, whether each
        replica's partial gradients of the step were bad (all-reduced: one
        float per replica); None on one replica."""
        bad = getattr(state, "replica_bad", None)
        context = distribute.shared_context()
        if bad is None or context is None:
            return None
        return context.all_reduce(tf.distribute.ReduceOp.SUM, _own_flag(context, bad)) > 0

    def _create(self, count):
        with tf.init_scope(), self.strategy.scope():
            self.variable = tf.Variable(
                tf.zeros((count,), tf.float32),
                name="kept_gradient/bad_replicas",
                **on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
            )

    def flags(self):
        """Bool array `[num_replicas]` of the kept step, or None if the
        training function has no such record (one replica)."""
        if self.variable is None:
            return None
        copies = self.strategy.experimental_local_results(self.variable)
        return np.sum([np.asarray(c) for c in copies], axis=0) > 0
