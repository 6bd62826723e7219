"""The keeping mechanism: gradient slots, unscaling, sparse storage.

Everything here touches TensorFlow graph machinery (tracing, `tf.Variable`
slots, `tf.init_scope`, distribution); `model.py` only orchestrates it.

Data path of one step: `unscale()` turns the gradients that `train_step`
computed from the scaled loss into what the optimizer's update receives,
`store()` writes them into the slots (one assign per variable; sparse
gradients stay sparse), and readers densify on read.
"""

import contextlib
import re
import threading

import keras
import tensorflow as tf
from keras import ops

__all__ = [
    "GradientKeeper",
    "current_step_gradients",
    "current_step_variables",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "nest_by_path",
    "unscale",
]


def _map_values(grad, fn):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def unscale(optimizer, variables, grads):
    """What the optimizer's update receives, from the scaled gradients.

    Mirrors Keras 3.15: `LossScaleOptimizer` divides each gradient by its
    dynamic scale with `ops.divide` (so float16 gradients become float32), and
    any other optimizer divides by its static `loss_scale_factor`. Variables
    with `overwrite_with_gradient` (FP8 scales) are assigned the raw value by
    the optimizer, unscaled, and so are kept raw. A variable the loss does not
    reach gets zeros that pass through the same division, so its dtype matches
    that of its neighbours.

    The dynamic scale is read here, before `optimizer.apply` may double or
    halve it.
    """
    divide = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
        scale = ops.convert_to_tensor(scale, dtype="float32")

        def divide(t):
            return ops.divide(t, scale)

    elif optimizer is not None and optimizer.loss_scale_factor is not None:
        factor = optimizer.loss_scale_factor

        def divide(t):
            return t / factor

    unscaled = []
    for variable, grad in zip(variables, grads):
        if grad is None:
            grad = tf.zeros(variable.shape, dtype=variable.dtype)
        if divide is not None and not getattr(variable, "overwrite_with_gradient", False):
            grad = _map_values(grad, divide)
        unscaled.append(grad)
    return unscaled


def densify(grad):
    """A dense tensor from a gradient; duplicate sparse indices are summed."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(
            grad.values, grad.indices, num_segments=grad.dense_shape[0]
        )
    return tf.convert_to_tensor(grad)


def nest_by_path(flat):
    """`{"a/b/c": x}` -> `{"a": {"b": {"c": x}}}`, as `get_state_tree()` nests."""
    nested = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


_step = threading.local()


@contextlib.contextmanager
def step_gradients(flat_grads, variables=None):
    """Makes this step's kept gradients (`{path: grad}`) visible to metrics.

    `variables` (`{path: variable}`, already updated by the optimizer) is
    for metrics that measure the update itself.
    """
    previous = getattr(_step, "grads", None), getattr(_step, "variables", None)
    _step.grads, _step.variables = flat_grads, variables
    try:
        yield
    finally:
        _step.grads, _step.variables = previous


def current_step_variables():
    """The `{path: variable}` of the training step being run, else None."""
    return getattr(_step, "variables", None)


@contextlib.contextmanager
def evaluation_step():
    """Marks a test step: gradient metrics skip it instead of failing."""
    previous = getattr(_step, "evaluating", False)
    _step.evaluating = True
    try:
        yield
    finally:
        _step.evaluating = previous


def in_evaluation_step():
    """Whether a `KeepGradModel` test step is being traced or run."""
    return getattr(_step, "evaluating", False)


def current_step_gradients():
    """The `{path: grad}` of the training step being traced or run, else None.

    Sparse gradients come as `tf.IndexedSlices`; `densify` them to read.
    """
    return getattr(_step, "grads", None)


def _spec_of(grad, dense_shape, sparse):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values
        if sparse:
            return ("sparse", values.dtype, tuple(values.shape[1:]), grad.indices.dtype)
        return ("dense", values.dtype, tuple(dense_shape))
    return ("dense", grad.dtype, tuple(grad.shape))


def _slot_name(path):
    return "kept_gradient/" + re.sub(r"[^A-Za-z0-9_./-]", "_", path)


class _Slot:
    """The non-trainable storage of one variable's kept gradient."""

    def __init__(self, path, spec, dense_shape, strategy):
        self.spec = spec
        self.dense_shape = tuple(dense_shape)
        name = _slot_name(path)
        with tf.init_scope(), strategy.scope():
            if spec[0] == "dense":
                _, dtype, shape = spec
                self.values = tf.Variable(
                    tf.zeros(shape, dtype), trainable=False, name=name
                )
                self.indices = None
            else:
                _, dtype, row_shape, index_dtype = spec
                self.values = tf.Variable(
                    tf.zeros((0,) + row_shape, dtype),
                    shape=tf.TensorShape((None,) + row_shape),
                    trainable=False,
                    name=name + "/values",
                )
                self.indices = tf.Variable(
                    tf.zeros((0,), index_dtype),
                    shape=tf.TensorShape((None,)),
                    trainable=False,
                    name=name + "/indices",
                )

    @property
    def dtype(self):
        return self.spec[1]

    def assign(self, grad):
        if self.indices is None:
            self.values.assign(densify(grad))
        else:
            self.values.assign(grad.values)
            self.indices.assign(grad.indices)

    def read(self):
        if self.indices is None:
            return tf.convert_to_tensor(self.values)
        return densify(
            tf.IndexedSlices(
                tf.convert_to_tensor(self.values),
                tf.convert_to_tensor(self.indices),
                self.dense_shape,
            )
        )


class GradientKeeper:
    """Owns one model's gradient slots, keyed by variable path.

    The slots are plain `tf.Variable`s held by this object, which is not a
    Keras layer nor a `tf.train.Checkpoint` trackable: so they are never in
    `model.weights`, checkpoints or exports.

    Args:
        sparse: Bool. Store `tf.IndexedSlices` gradients as (values, indices)
            of the batch's rows instead of densifying them on every step. XLA
            cannot write a variable whose shape changes, so a model compiled
            with `jit_compile=True` keeps them dense.
    """

    def __init__(self, sparse=True):
        self.sparse = sparse
        self._slots = {}
        self._step = None  # counts steps, only with `keep_every > 1`
        # Paths of the variables the current training function writes, in
        # order; None until slots exist.
        self.paths = None

    @property
    def built(self):
        return self.paths is not None

    def rebuild(self, variables, grads, strategy):
        """Fresh zero slots for `variables`, shaped after traced `grads`."""
        self._slots = {}
        self.paths = None
        for variable, grad in zip(variables, grads):
            self._slot_for(variable, grad, strategy)
        self.paths = tuple(v.path for v in variables)

    def _slot_for(self, variable, grad, strategy):
        spec = _spec_of(grad, variable.shape, self.sparse)
        slot = self._slots.get(variable.path)
        if slot is None or slot.spec != spec:
            slot = _Slot(variable.path, spec, variable.shape, strategy)
            self._slots[variable.path] = slot
        return slot

    def store(self, variables, grads, strategy, every=1):
        """Writes one step's unscaled gradients; creates missing slots.

        A slot is only created here when no spec was traced beforehand (e.g.
        `train_step` called directly); `tf.init_scope` lifts it out of the
        function being traced. With `every > 1` only steps 1, 1 + every,
        1 + 2 * every, ... are written (counted by the keeper itself, so
        skipped loss-scale steps and gradient accumulation count as steps).
        """
        slots = [self._slot_for(v, g, strategy) for v, g in zip(variables, grads)]
        self.paths = tuple(v.path for v in variables)

        def write():
            for slot, grad in zip(slots, grads):
                slot.assign(grad)
            return tf.constant(True)

        if every == 1:
            write()
            return
        if self._step is None:
            with tf.init_scope(), strategy.scope():
                self._step = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="kept_gradient/step"
                )
        tf.cond(
            tf.equal(self._step % every, 0), write, lambda: tf.constant(False)
        )
        self._step.assign_add(1)

    def slot_dtypes(self):
        """`{path: dtype}` of the slots the training function writes."""
        return {path: self._slots[path].dtype for path in self.paths}

    def read(self):
        """`{path: dense tensor}` of the last kept step, in variable order."""
        return {path: self._slots[path].read() for path in self.paths}

    def restore(self, variables, arrays, strategy):
        """Writes saved dense gradients (`{path: array}`) into the slots.

        Used when loading a file saved with `save_gradients=True`. Existing
        slots are written in place (a traced training function keeps writing
        the same variables; sparse ones get every row); missing slots are
        created dense, with the saved dtype.
        """
        for variable in variables:
            value = tf.convert_to_tensor(arrays[variable.path])
            slot = self._slots.get(variable.path)
            if slot is None or slot.dtype != value.dtype:
                spec = ("dense", value.dtype, tuple(value.shape))
                slot = _Slot(variable.path, spec, variable.shape, strategy)
                self._slots[variable.path] = slot
            if slot.indices is not None:
                rows = tf.range(tf.shape(value)[0], dtype=slot.indices.dtype)
                value = tf.IndexedSlices(value, rows, slot.dense_shape)
            slot.assign(value)
        self.paths = tuple(v.path for v in variables)

    def slot_variables(self):
        """Every `tf.Variable` the keeper holds (for tests and saving)."""
        out = []
        for path in self.paths or ():
            slot = self._slots[path]
            out.append(slot.values)
            if slot.indices is not None:
                out.append(slot.indices)
        return out
