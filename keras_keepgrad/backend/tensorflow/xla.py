"""XLA support for the TensorFlow keeper: sparse slots written after the step.

XLA cannot write a variable whose shape changes, and a sparse slot holds as
many rows as the batch has. A step compiled with XLA therefore returns the
rows of its sparse gradients and they are written after it
(`DeferredSparseWrites`), unless the optimizer's update densifies the
gradient anyway (`densified_in`): then the slot is dense and XLA computes the
dense tensor once for both.
"""

import contextlib
import types

import tensorflow as tf

from keras_keepgrad.backend.tensorflow import skipping

__all__ = ["DeferredSparseWrites", "densified_in", "writes_sparse_after_xla"]


def densified_in(graph, grads, variables):
    """The paths of the `variables` whose `tf.IndexedSlices` gradient `graph` densifies.

    Looks for what TensorFlow's IndexedSlices-to-Tensor conversion emits, and
    `densify` too: an `UnsortedSegmentSum` of exactly the gradient's values
    and indices into a tensor of its variable's (static) shape. Keras's Adam,
    for one, densifies a sparse gradient so. A step that computes it anyway
    gets the dense slot write for free under XLA, which computes the
    identical sum once. Ops inside nested functions (a `tf.cond`'s branches)
    are not looked at: their gradients count as not densified.
    """
    wanted = {
        (grad.values.name, grad.indices.name): variable
        for grad, variable in zip(grads, variables)
        if isinstance(grad, tf.IndexedSlices)
    }
    found = set()
    for op in graph.get_operations():
        if op.type == "UnsortedSegmentSum":
            variable = wanted.get((op.inputs[0].name, op.inputs[1].name))
            if variable is not None and op.outputs[0].shape == tuple(variable.shape):
                found.add(variable.path)
    return found


def writes_sparse_after_xla(jit_compile, run_eagerly, strategy):
    """Whether a step is compiled with XLA and sparse slots written after it.

    Not under a `tf.distribute` strategy (other than one device): its
    replica threads cannot `merge_call` (as Keras's optimizer does) from a
    function nested in `strategy.run`, so there the slots are dense.

    Args:
        jit_compile: The model's `jit_compile`.
        run_eagerly: The model's `run_eagerly`.
        strategy: The strategy the model was made under, or None.
    """
    return (
        jit_compile
        and not run_eagerly
        and (strategy is None or isinstance(strategy, tf.distribute.OneDeviceStrategy))
    )


class DeferredSparseWrites:
    """The part of the TensorFlow keeper that writes sparse slots after XLA.

    Attributes:
        choose_dense: Bool. Under `deferring_sparse_writes`, keep a sparse
            gradient dense where the optimizer's update densifies it anyway.
        dense_paths: The paths kept dense for that reason.
    """

    def __init__(self, choose_dense=False):
        self.choose_dense = choose_dense
        self.dense_paths = set()
        self._deferred = None  # see `deferring_sparse_writes`
        self._deferred_slots = []

    def _choose_dense_after(self, variables, grads):
        return (
            self.choose_dense
            and self._deferred is not None
            and any(
                isinstance(g, tf.IndexedSlices) and v.path not in self._slots
                for v, g in zip(variables, grads)
            )
        )

    @contextlib.contextmanager
    def deferring_sparse_writes(self):
        """Sparse slot writes in the block are collected, not made.

        For a step compiled with XLA, which cannot write a variable whose
        shape changes (a sparse slot holds as many rows as the batch has).
        Yields a namespace whose `tensors()` are to be returned out of the
        compiled function and handed to `write_deferred` outside it: the
        batch's (values, indices) per sparse slot, and with `every > 1`
        whether the step was written.
        """
        deferred = types.SimpleNamespace(
            slots=[],
            values=[],
            indices=[],
            wrote=None,
            tensors=lambda: (deferred.values, deferred.indices, deferred.wrote),
        )
        previous, self._deferred = self._deferred, deferred
        try:
            yield deferred
        finally:
            self._deferred = previous
        self._deferred_slots = deferred.slots

    def with_sparse_writes_after_xla(self, step_function):
        """`step_function` compiled with XLA, its sparse slots written after.

        Keras compiles its whole step function with XLA when `jit_compile`;
        this compiles the step alone, returns the batch's rows of the sparse
        gradients out of it, and writes them in the same training function.
        """

        # The host calls of the step as last traced (`skipping.call_if`):
        # their flags and tensors come out of the XLA program, their
        # `tf.numpy_function`s run after it.
        traced = types.SimpleNamespace(calls=[])

        @tf.autograph.experimental.do_not_convert
        def compiled(data):
            with (
                self.deferring_sparse_writes() as deferred,
                skipping.deferring_host_calls() as calls,
            ):
                logs = step_function(data)
            traced.calls = [(names, fn) for _, names, _, fn in calls]
            return logs, deferred.tensors(), [(flag, values) for flag, _, values, _ in calls]

        compiled = tf.function(compiled, reduce_retracing=True, jit_compile=True)

        @tf.autograph.experimental.do_not_convert
        def step(data):
            logs, rows, host = compiled(data)
            self.write_deferred(rows)
            for (flag, values), (names, fn) in zip(host, traced.calls):
                skipping.host_cond(flag, names, values, fn)
            return logs

        return step

    def write_deferred(self, tensors):
        """Makes the sparse writes a `deferring_sparse_writes` block collected.

        `tensors` is what its `tensors()` returned, passed out of the
        compiled function.
        """
        values, indices, wrote = tensors
        if not self._deferred_slots:
            return

        def write():
            for slot, v, i in zip(self._deferred_slots, values, indices):
                slot.values.assign(v, read_value=False)
                slot.indices.assign(i, read_value=False)
            return tf.constant(True)

        if wrote is None:
            write()
        else:
            tf.cond(wrote, write, lambda: tf.constant(False))
