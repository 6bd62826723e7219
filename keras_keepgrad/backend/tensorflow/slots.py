"""Slots: the `tf.Variable`s that hold kept gradients on TensorFlow.

Plain variables, not Keras ones nor `tf.train.Checkpoint` trackables, made
under the model's strategy with one copy per replica (`ON_READ`): never in
`model.weights`, checkpoints or exports.
"""

import re

import tensorflow as tf

__all__ = ["Slot", "densify", "map_both", "map_values", "on_read", "spec_of"]


def map_values(grad, fn):
    """`fn` applied to a gradient's values (a `tf.IndexedSlices` stays sparse)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def map_both(grad, fn):
    """`fn` applied to a gradient's values and, if sparse, its indices."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), fn(grad.indices), grad.dense_shape)
    return fn(grad)


def densify(grad):
    """A dense tensor from a gradient; duplicate sparse indices are summed."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(
            grad.values, grad.indices, num_segments=grad.dense_shape[0]
        )
    return tf.convert_to_tensor(grad)


def spec_of(grad, dense_shape, sparse):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values
        if sparse:
            # A row's shape from the variable: the step's all-reduce (across
            # workers) gathers rows whose static shape it does not keep.
            return ("sparse", values.dtype, tuple(dense_shape[1:]))
        return ("dense", values.dtype, tuple(dense_shape))
    # A dense gradient has its variable's shape. Where the step's inputs
    # have unknown dimensions (a dataset without a full spec, such as an
    # iterable torch DataLoader), the trace leaves some of it unknown.
    return ("dense", grad.dtype, tuple(grad.shape.merge_with(dense_shape)))


def _slot_name(path):
    return "kept_gradient/" + re.sub(r"[^A-Za-z0-9_./-]", "_", path)


def on_read(aggregation):
    # One copy per replica, written by that replica without communication.
    # Without a strategy, a plain variable.
    return dict(
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
    )


class Slot:
    """The non-trainable storage of one variable's kept gradient.

    Created under the model's strategy with one copy per replica
    (`ON_READ`), which each replica writes in its step. With
    `partial=True` the copies hold the replicas' partial gradients and a
    read sums this process's copies (`SUM` aggregation: an assignment
    outside the step splits the value among them); otherwise each copy
    holds the whole gradient and a read takes the first. A sparse slot's
    indices keep the dtype of the first gradient's (`index_dtype`); later
    ones are cast to it (`cast_indices`), so a retrace on ids of another
    dtype (a subclassed model's inputs are not cast) writes the same slot
    rather than needing a new variable mid-trace.
    """

    def __init__(self, path, spec, dense_shape, strategy, partial=False, index_dtype=tf.int64):
        self.spec = spec
        self.dense_shape = tuple(dense_shape)
        self.strategy = strategy
        self.partial = partial
        values = on_read(
            tf.VariableAggregation.SUM if partial else tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
        name = _slot_name(path)
        with tf.init_scope(), strategy.scope():
            if spec[0] == "dense":
                _, dtype, shape = spec
                self.values = tf.Variable(tf.zeros(shape, dtype), name=name, **values)
                self.indices = None
            else:
                _, dtype, row_shape = spec
                self.values = tf.Variable(
                    tf.zeros((0,) + row_shape, dtype),
                    shape=tf.TensorShape((None,) + row_shape),
                    name=name + "/values",
                    **values,
                )
                self.indices = tf.Variable(
                    tf.zeros((0,), index_dtype),
                    shape=tf.TensorShape((None,)),
                    name=name + "/indices",
                    **on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
                )

    @property
    def dtype(self):
        return self.spec[1]

    def cast_indices(self, indices):
        """`indices` in this sparse slot's index dtype (no op if already)."""
        return tf.cast(indices, self.indices.dtype)

    def assign(self, grad):
        """Writes `grad`; returns the write ops (None where eager)."""
        if self.indices is None:
            return [self.values.assign(densify(grad), read_value=False)]
        return [
            self.values.assign(grad.values, read_value=False),
            self.indices.assign(self.cast_indices(grad.indices), read_value=False),
        ]

    def _copies(self, variable):
        return [tf.convert_to_tensor(v) for v in self.strategy.experimental_local_results(variable)]

    def read(self):
        copies = self._copies(self.values)
        if self.indices is not None:
            copies = [
                densify(tf.IndexedSlices(v, i, self.dense_shape))
                for v, i in zip(copies, self._copies(self.indices))
            ]
        if self.partial and len(copies) > 1:
            return tf.add_n(copies)
        return copies[0]
