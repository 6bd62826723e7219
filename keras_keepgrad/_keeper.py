"""The keeping mechanism: gradient slots, unscaling, sparse storage.

Everything here touches TensorFlow graph machinery (tracing, `tf.Variable`
slots, `tf.init_scope`, distribution); `model.py` only orchestrates it.

Data path of one step: `unscale()` turns the gradients that `train_step`
computed from the scaled loss into what the optimizer's update receives,
`store()` writes them into the slots (one assign per variable; sparse
gradients stay sparse), `after()` makes the optimizer's update of each
variable wait for its slot write, and readers densify on read. Under XLA,
which cannot write a variable whose shape changes, sparse slots are written
after the compiled step (`GradientKeeper.deferring_sparse_writes`), unless
the optimizer's update densifies the gradient anyway (`densified_in`): then
the slot is dense and XLA computes the dense tensor once for both.
"""

import collections
import contextlib
import itertools
import re
import threading
import types

import keras
import tensorflow as tf
from keras import ops

__all__ = [
    "GradientKeeper",
    "after",
    "agree_on_skip",
    "all_reduce_sum",
    "current_step_gradients",
    "current_step_variables",
    "densified_in",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "nest_by_path",
    "reduces_in_step",
    "replica_spec",
    "unscale",
    "with_batch_axis",
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


def after(writes, grads):
    """`grads`, each as a tensor that exists only once its slot is written.

    `train_step` hands the optimizer these, so that each slot write comes
    before the optimizer's update of that variable. Without XLA the write
    copies nothing: TensorFlow's `AssignVariableOp` makes the slot (which no
    sparse op touches, so it is not in copy-on-read mode) share the
    gradient's buffer, copy-on-write, and the slot holds it until the next
    write. That is the one parameter-sized buffer keeping costs; the price
    is that the update's ops cannot reuse that buffer for their results.
    The order rests on a measurement (10M-parameter MLP, peak RSS over plain
    Keras: +38 to +43 MiB ordered, +39 to +82 MiB unordered, for 40 MiB of
    parameters; step time unchanged within noise). The reason first given
    for it, that the write copies unless it comes last, is wrong (a profile
    shows 2 to 5 us per 2 MiB write), and why unordered writes sometimes
    peaked higher is not known. Each gradient waits for its own write (with
    `keep_every > 1`, for the conditional write of all; Keras 3.15's
    optimizers start updating once all gradients exist anyway).
    `tf.identity` aliases, copies nothing.

    Args:
        writes: Per gradient, a list of the ops (or tensors) that must run
            before the optimizer reads it.
        grads: The gradients the optimizer is to receive.
    """
    if tf.executing_eagerly():
        return grads
    ordered = []
    for ops, grad in zip(writes, grads):
        ops = [op for op in ops if op is not None]
        if grad is None or not ops:
            ordered.append(grad)
            continue
        with tf.control_dependencies(ops):
            ordered.append(_map_both(grad, tf.identity))
    return ordered


def _map_both(grad, fn):
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
def step_gradients(flat_grads, variables=None, reduced=False):
    """Makes this step's kept gradients (`{path: grad}`) visible to metrics.

    `variables` (`{path: variable}`, already updated by the optimizer) is
    for metrics that measure the update itself. Under a `tf.distribute`
    strategy `flat_grads` are this replica's partial gradients unless
    `reduced=True` says they already are the global ones; metrics see global
    ones either way (see `current_step_gradients`).
    """
    previous = (
        getattr(_step, "grads", None),
        getattr(_step, "variables", None),
        getattr(_step, "reduced", True),
    )
    _step.grads, _step.variables, _step.reduced = flat_grads, variables, reduced
    try:
        yield
    finally:
        _step.grads, _step.variables, _step.reduced = previous


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
    Under a `tf.distribute` strategy they are the global-batch gradients, the
    same on every replica: the first call in a step all-reduces the
    replicas' partial gradients (one all-reduce per step, only in steps
    where some metric asks).
    """
    grads = getattr(_step, "grads", None)
    if grads is not None and not _step.reduced:
        grads = dict(zip(grads, all_reduce_sum(list(grads.values()))))
        _step.grads, _step.reduced = grads, True
    return grads


# Distribution --------------------------------------------------------------
#
# Under `tf.distribute`, `train_step` runs once per replica, on that
# replica's share of the global batch, and Keras scales each replica's loss
# by `1 / num_replicas`: a replica's gradient is its partial sum, and the
# global-batch gradient (what one device computes) is the sum over replicas.
# The optimizer all-reduces its own, possibly clipped, copy later.


def all_reduce_sum(grads):
    """Sums per-replica gradients over the replicas (identity on one).

    Must run in a replica context (inside `strategy.run`, e.g. in
    `train_step`). `tf.IndexedSlices` are gathered, rows concatenated.
    """
    context = tf.distribute.get_replica_context()
    grads = list(grads)
    if context is None or context.num_replicas_in_sync == 1 or not grads:
        return grads
    return list(context.all_reduce(tf.distribute.ReduceOp.SUM, grads))


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
    context = tf.distribute.get_replica_context()
    if (
        not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        or context is None
        or context.num_replicas_in_sync == 1
    ):
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    overflowed = tf.cast(tf.logical_not(optimizer.check_finite(present)), tf.float32)
    finite = tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed), 0.0)

    def nan(t):
        return tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype))

    present = iter(
        tf.cond(finite, lambda: present, lambda: [_map_values(g, nan) for g in present])
    )
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


def _spec_of(grad, dense_shape, sparse):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values
        if sparse:
            # A row's shape from the variable: the step's all-reduce (across
            # workers) gathers rows whose static shape it does not keep.
            return ("sparse", values.dtype, tuple(dense_shape[1:]))
        return ("dense", values.dtype, tuple(dense_shape))
    return ("dense", grad.dtype, tuple(grad.shape))


def _slot_name(path):
    return "kept_gradient/" + re.sub(r"[^A-Za-z0-9_./-]", "_", path)


def _on_read(aggregation):
    # One copy per replica, written by that replica without communication.
    # Without a strategy, a plain variable.
    return dict(
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
    )


class _Slot:
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

    def __init__(
        self, path, spec, dense_shape, strategy, partial=False, index_dtype=tf.int64
    ):
        self.spec = spec
        self.dense_shape = tuple(dense_shape)
        self.strategy = strategy
        self.partial = partial
        values = _on_read(
            tf.VariableAggregation.SUM
            if partial
            else tf.VariableAggregation.ONLY_FIRST_REPLICA
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
                    **_on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
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
        return [
            tf.convert_to_tensor(v)
            for v in self.strategy.experimental_local_results(variable)
        ]

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


def _check_unique_paths(variables):
    """Raises if two variables share a path: slots and reads are keyed by it."""
    counts = collections.Counter(v.path for v in variables)
    shared = sorted(path for path, n in counts.items() if n > 1)
    if shared:
        raise ValueError(
            "Kept gradients are keyed by variable path, and several trainable "
            f"variables share the path{'s' if len(shared) > 1 else ''} "
            f"{', '.join(repr(p) for p in shared)} (two layers with the same "
            "`name`?). Give each layer a unique `name`, or build the model "
            "with `keep_gradients=False`."
        )


_KEEPER_SERIALS = itertools.count()


class GradientKeeper:
    """Owns one model's gradient slots, keyed by variable path.

    The slots are plain `tf.Variable`s held by this object, which is not a
    Keras layer nor a `tf.train.Checkpoint` trackable: so they are never in
    `model.weights`, checkpoints or exports.

    Args:
        sparse: Bool. Store `tf.IndexedSlices` gradients as (values, indices)
            of the batch's rows instead of densifying them on every step.
            XLA cannot write a variable whose shape changes: a step compiled
            with XLA writes sparse slots through `deferring_sparse_writes`,
            or the keeper must be dense.

    Attributes:
        dense_paths: Paths of variables whose sparse gradients are stored
            dense even so (under XLA, where the optimizer densifies them
            anyway: see `densified_in`); set before `rebuild`.
    """

    def __init__(self, sparse=True):
        self.sparse = sparse
        self.dense_paths = frozenset()
        self._deferred = None  # see `deferring_sparse_writes`
        self._deferred_slots = []
        self._serial = next(_KEEPER_SERIALS)  # tells keepers apart in `last_write`
        self._slots = {}
        self._step = None  # counts steps, only with `keep_every > 1`
        self._written = None  # `_step` at the last write, likewise
        # Paths of the variables the current training function writes, in
        # order; None until slots exist.
        self.paths = None

    @property
    def built(self):
        return self.paths is not None

    def has_sparse_slots(self):
        """Whether some slot holds a sparse gradient as (values, indices)."""
        return any(slot.indices is not None for slot in self._slots.values())

    def rebuild(self, variables, grads, strategy):
        """Fresh zero slots for `variables`, shaped after traced `grads`."""
        _check_unique_paths(variables)
        self._slots = {}
        self.paths = None
        for variable, grad in zip(variables, grads):
            self._slot_for(variable, grad, strategy)
        self.paths = tuple(v.path for v in variables)

    def _slot_for(self, variable, grad, strategy):
        sparse = self.sparse and variable.path not in self.dense_paths
        spec = _spec_of(grad, variable.shape, sparse)
        partial = strategy.num_replicas_in_sync > 1 and not reduces_in_step(strategy)
        slot = self._slots.get(variable.path)
        if (
            slot is None
            or slot.spec != spec
            or slot.strategy is not strategy
            or slot.partial != partial
        ):
            index_dtype = (
                grad.indices.dtype if isinstance(grad, tf.IndexedSlices) else tf.int64
            )
            slot = _Slot(
                variable.path, spec, variable.shape, strategy, partial, index_dtype
            )
            self._slots[variable.path] = slot
        return slot

    def store(self, variables, grads, strategy, every=1):
        """Writes one step's unscaled gradients; creates missing slots.

        A slot is only created here when no spec was traced beforehand (e.g.
        `train_step` called directly); `tf.init_scope` lifts it out of the
        function being traced. With `every > 1` only steps 1, 1 + every,
        1 + 2 * every, ... are written (counted by the keeper itself, so
        skipped loss-scale steps and gradient accumulation count as steps).

        Under a strategy each replica writes its own partial gradient, with
        no communication, and reads sum them; across worker processes the
        gradients are all-reduced here first (`reduces_in_step`).

        Returns:
            `(grads, reduced, writes)`: the gradients as this replica now
            holds them, whether they are the global ones, and for each
            gradient the ops that wrote it, or with `every > 1` the
            conditional write of all (for `after`; None when executing
            eagerly; none for a sparse slot under `deferring_sparse_writes`).
        """
        _check_unique_paths(variables)
        reduced = reduces_in_step(strategy)
        if reduced:
            grads = all_reduce_sum(grads)
        slots = [self._slot_for(v, g, strategy) for v, g in zip(variables, grads)]
        self.paths = tuple(v.path for v in variables)

        # Under `deferring_sparse_writes`, sparse slots are written later.
        deferred = self._deferred
        here = [deferred is None or slot.indices is None for slot in slots]
        for slot, grad, now in zip(slots, grads, here):
            if not now:
                deferred.slots.append(slot)
                deferred.values.append(grad.values)
                deferred.indices.append(slot.cast_indices(grad.indices))

        def write():
            for slot, grad, now in zip(slots, grads, here):
                if now:
                    slot.assign(grad)
            self._written.assign(self._step)
            return tf.constant(True)

        if every == 1:
            writes = [
                slot.assign(grad) if now else []
                for slot, grad, now in zip(slots, grads, here)
            ]
            return grads, reduced, writes
        if self._step is None:
            self._create_step_counter(strategy)
        wrote = tf.cond(
            tf.equal(self._step % every, 0), write, lambda: tf.constant(False)
        )
        self._step.assign_add(1)
        if deferred is not None:
            deferred.wrote = wrote
        return grads, reduced, [[wrote]] * len(grads)

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
            slots=[], values=[], indices=[], wrote=None,
            tensors=lambda: (deferred.values, deferred.indices, deferred.wrote),
        )
        previous, self._deferred = self._deferred, deferred
        try:
            yield deferred
        finally:
            self._deferred = previous
        self._deferred_slots = deferred.slots

    def write_deferred(self, tensors):
        """Makes the sparse writes a `deferring_sparse_writes` block collected.

        `tensors` is what its `tensors()` returned, passed out of the
        compiled function. Returns a bool tensor: whether it wrote.
        """
        values, indices, wrote = tensors

        def write():
            for slot, v, i in zip(self._deferred_slots, values, indices):
                slot.values.assign(v, read_value=False)
                slot.indices.assign(i, read_value=False)
            return tf.constant(True)

        if wrote is None:
            return write()
        return tf.cond(wrote, write, lambda: tf.constant(False))

    def last_write(self):
        """`(write, age)`: which write the slots hold, and from how long ago.

        `age` is the number of training steps run since the one whose
        gradients the slots hold (0: the last step's). `write` identifies
        that write (equal values: the same gradients), or is None where
        every step writes (`keep_every=1`) and the slots always hold the last
        step's. Also `(None, 0)` before any step.
        """
        if self._step is None:
            return None, 0
        step = int(self._step.read_value().numpy())
        written = int(self._written.read_value().numpy())
        if written < 0:
            return None, 0
        return (self._serial, written), step - 1 - written

    def _create_step_counter(self, strategy):
        def create(*_):
            with tf.init_scope(), strategy.scope():
                # Each replica counts the steps in its own copy, and notes
                # the count at the step it last wrote (-1: none yet).
                self._step = tf.Variable(
                    tf.constant(0, tf.int64),
                    name="kept_gradient/step",
                    **_on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
                )
                self._written = tf.Variable(
                    tf.constant(-1, tf.int64),
                    name="kept_gradient/written",
                    **_on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
                )

        context = tf.distribute.get_replica_context()
        if tf.distribute.has_strategy() and context is not None:
            # In a replica's step: a strategy creates variables only in its
            # cross-replica context, once for all replicas.
            context.merge_call(create)
        else:
            create()

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
