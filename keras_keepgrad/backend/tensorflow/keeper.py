"""The keeping mechanism on TensorFlow: gradient slots, unscaling, sparse storage.

Everything here touches TensorFlow graph machinery (tracing, `tf.Variable`
slots, `tf.init_scope`, distribution); `model.py` only orchestrates it, and
`_capture.py` brings each optimizer's gradients here.

Data path of one `optimizer.apply` in a training step:
`GradientKeeper.keep_from_optimizer` turns the gradients the step handed
over (computed from the scaled loss) into what the optimizer's update
receives (`unscale`), `store()` writes them into the slots (one assign per
variable; sparse gradients stay sparse; slots missing at the first trace
are made there), `after()` makes the optimizer's update of each variable
wait for its slot write, and readers densify on read. Under XLA, which
cannot write a variable whose shape changes, sparse slots are written after
the compiled step (`GradientKeeper.deferring_sparse_writes`), unless the
optimizer's update densifies the gradient anyway (`densified_in`): then the
slot is dense and XLA computes the dense tensor once for both.
"""

import contextlib
import functools
import re
import types

import keras
import tensorflow as tf

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad import _stats
from keras_keepgrad._capture import evaluation_step
from keras_keepgrad._capture import in_evaluation_step
from keras_keepgrad._capture import nest_by_path

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
    "none_for_none_spec",
    "reduces_in_step",
    "replica_spec",
    "unscale",
    "with_batch_axis",
    "writes_sparse_after_xla",
]


def _map_values(grad, fn):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def unscale(optimizer, variables, grads):
    """What the optimizer's update receives, from the scaled gradients.

    `_capture.unscale`, with `tf.IndexedSlices` gradients divided in their
    values (they stay sparse).
    """
    return _capture.unscale(optimizer, variables, grads, map_values=_map_values)


def after(writes, grads):
    """`grads`, each as a tensor that exists only once its slot is written.

    The optimizer receives these, so that each slot write comes before the
    update of its variable. Without XLA the write copies nothing: the slot
    shares the gradient's buffer, copy-on-write, until the next write, so
    keeping costs one parameter-sized buffer, and this order keeps it at
    one (the update cannot reuse that buffer for its results). With
    `keep_every > 1` each gradient waits for the conditional write of all.
    `tf.identity` aliases, copies nothing.

    Args:
        writes: Per gradient, a list of the ops (or tensors) that must run
            before the optimizer reads it.
        grads: The gradients the optimizer is to receive.
    """
    if tf.executing_eagerly():
        return grads
    ordered = []
    for write_ops, grad in zip(writes, grads):
        write_ops = [op for op in write_ops if op is not None]
        if grad is None or not write_ops:
            ordered.append(grad)
            continue
        with tf.control_dependencies(write_ops):
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


def current_step_variables():
    """The `{path: variable}` the training step being run has kept, else None.

    The variables are those the optimizers received, already updated where
    an optimizer's `apply` ran.
    """
    step = _capture.current_step()
    return None if step is None else step.variables


def current_step_gradients():
    """The `{path: grad}` kept so far in the training step being run, else None.

    `{}` in a training step where no optimizer received gradients yet.
    Sparse gradients come as `tf.IndexedSlices`; `densify` them to read.
    Under a `tf.distribute` strategy they are the global-batch gradients, the
    same on every replica: a call in a step all-reduces the replicas'
    partial gradients kept since the previous call (one all-reduce per
    step, only in steps where some metric asks).
    """
    step = _capture.current_step()
    if step is None:
        return None
    if step.reduced:
        return step.grads
    summed = step.backend_state.summed
    todo = [path for path in step.grads if path not in summed]
    if todo:
        summed.update(zip(todo, all_reduce_sum([step.grads[p] for p in todo])))
    return {path: summed[path] for path in step.grads}


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
        result = all_reduce_sum_gradients(optimizer, grads_and_vars)
        step = _capture.current_step()
        state = getattr(step, "backend_state", None)
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

    present = iter(tf.cond(finite, lambda: present, lambda: [_map_values(g, nan) for g in present]))
    return [None if g is None else next(present) for g in grads]


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
    # A dense gradient has its variable's shape. Where the step's inputs
    # have unknown dimensions (a dataset without a full spec, such as an
    # iterable torch DataLoader), the trace leaves some of it unknown.
    return ("dense", grad.dtype, tuple(grad.shape.merge_with(dense_shape)))


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

    def __init__(self, path, spec, dense_shape, strategy, partial=False, index_dtype=tf.int64):
        self.spec = spec
        self.dense_shape = tuple(dense_shape)
        self.strategy = strategy
        self.partial = partial
        values = _on_read(
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


def _check_unconditional(step, call):
    """Raises if `call` is traced inside a `tf.cond` or loop of the step.

    Slots written there would keep their last values on the steps where
    the branch does not run (before its first run: zeros), and the
    statistics read after the step could not reach the branch's tensors:
    kept gradients are those of every step that runs. A Python `if` on
    Python values and a `for` over `range` trace no control flow (Keras
    does not convert `train_step` with AutoGraph).
    """
    # Up from where `call` is traced to the step's graph, or to the
    # outermost graph for a step that runs eagerly (a `tf.function` of its
    # own can hold the condition).
    outer = step.backend_state.graph
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    while graph is not None and graph is not outer:
        if isinstance(graph, _compat.ControlFlowFuncGraph):
            raise RuntimeError(
                f"{call} was called inside a `tf.cond` or `tf.while_loop` "
                f"in the training step of model {step.model.name!r}. "
                "Its kept gradients would be stale on the steps where that "
                "branch does not run, so `KeepGradModel` refuses it. Call it "
                "on every step, outside the condition or loop (a Python `for` "
                "over `range(n)` is unrolled and fine), or train with "
                "`run_eagerly=True`, where a Python `if` decides at each step "
                "and a step keeps the gradients its optimizers did receive."
            )
        graph = getattr(graph, "outer_graph", None)


class GradientKeeper(_capture.Keeper):
    """Owns one model's gradient slots, keyed by variable path.

    The slots are plain `tf.Variable`s held by this object, which is not a
    Keras layer nor a `tf.train.Checkpoint` trackable: so they are never in
    `model.weights`, checkpoints or exports. They are made while the real
    training step is first traced, from the gradients its optimizers
    receive there: their shapes and dtypes are those of that step.

    Args:
        strategy: The model's `tf.distribute` strategy.
        sparse: Bool. Store `tf.IndexedSlices` gradients as (values, indices)
            of the batch's rows instead of densifying them on every step.
            XLA cannot write a variable whose shape changes: a step compiled
            with XLA writes sparse slots through `deferring_sparse_writes`,
            or the keeper must be dense.
        every: Positive int. Write the slots on steps 1, 1 + every, ...
        choose_dense: Bool. Under `deferring_sparse_writes`, keep a sparse
            gradient dense where the optimizer's update densifies it anyway
            (`densified_in`): XLA then computes the dense tensor once for
            both, and the rows need no copy out of the compiled step.

    Attributes: as `_capture.Keeper`'s.
    """

    def __init__(self, strategy, sparse=True, every=1, choose_dense=False):
        super().__init__(every)
        self.strategy = strategy
        self.sparse = sparse
        self.choose_dense = choose_dense
        self.dense_paths = set()
        self._deferred = None  # see `deferring_sparse_writes`
        self._deferred_slots = []
        self._slots = {}
        self._step = None  # counts steps, only with `every > 1`
        self._written = None  # `_step` at the last write, likewise

    def has_sparse_slots(self):
        """Whether some slot holds a sparse gradient as (values, indices)."""
        return any(slot.indices is not None for slot in self._slots.values())

    # One training step -------------------------------------------------

    def begin_step(self, step):
        """Before the model's `train_step`: what this step writes under."""
        step.backend_state = types.SimpleNamespace(
            summed={},
            write_now=None,
            passed={},
            summed_by_update={},
            graph=None if tf.executing_eagerly() else tf.compat.v1.get_default_graph(),
        )
        if self.every > 1:
            if self._step is None:
                self._create_step_counter(self.strategy)
            step.backend_state.write_now = tf.equal(self._step % self.every, 0)
            if self._deferred is not None:
                self._deferred.wrote = step.backend_state.write_now

    def end_step(self, step):
        """After the model's `train_step`: which variables it kept."""
        kept = _capture.finish_step(self, step, update="optimizer.apply")
        if kept:
            # The per-layer statistics the callbacks read (if one asked).
            _stats.record(
                step.model,
                {path: step.grads[path] for path in kept},
                reduced=step.reduced,
                wrote=step.backend_state.write_now,
            )
        if self._step is not None:
            self._step.assign_add(1)

    def keep_from_optimizer(self, step, optimizer, variables, grads, apply):
        """Keeps what `optimizer.apply` receives, then runs `apply`.

        Args:
            step: The current `_capture.Step`.
            optimizer: The optimizer whose `apply` was called.
            variables: The variables it updates.
            grads: The gradients it was given (loss-scaled, if the loss
                was scaled).
            apply: Runs the optimizer's own `apply` on a list of gradients.

        Returns:
            What `apply` returns.
        """
        _check_unconditional(step, f"`{type(optimizer).__name__}.apply`")
        kept = unscale(optimizer, variables, grads)
        if self._choose_dense_after(variables, kept):
            # The update's own ops tell which sparse gradients it densifies:
            # trace it first, then make the slots (all writes under XLA,
            # where the order is XLA's).
            result = apply(agree_on_skip(optimizer, grads))
            graph = tf.compat.v1.get_default_graph()
            self.dense_paths.update(densified_in(graph, kept, variables))
            kept, reduced, _ = self.store(variables, kept, step)
        else:
            kept, reduced, writes = self.store(variables, kept, step)
            # Each slot write before the update of its variable: see `after`.
            passed = agree_on_skip(optimizer, after(writes, grads))
            state = step.backend_state
            if not reduced and tf.distribute.get_replica_context() is not None:
                # Partial gradients the update receives as they are kept:
                # its own all-reduce of them gives their global sums.
                state.passed = {
                    id(p): (p, v.path)
                    for v, g, k, p in zip(variables, grads, kept, passed)
                    if k is g and p is not None
                }
            try:
                result = apply(passed)
            finally:
                state.passed = {}
        self._record(step, variables, kept, reduced)
        # After `_record`, which drops sums of earlier calls for them.
        step.backend_state.summed.update(step.backend_state.summed_by_update)
        step.backend_state.summed_by_update = {}
        return result

    def keep_given(self, step, variables, grads):
        """Keeps `grads` as given (a step without optimizer); returns them
        ordered after their slot writes."""
        _check_unconditional(step, "`keep_step_gradients`")
        kept = [
            tf.zeros(v.shape, dtype=v.dtype) if g is None else g for v, g in zip(variables, grads)
        ]
        kept, reduced, writes = self.store(variables, kept, step)
        self._record(step, variables, kept, reduced)
        return after(writes, list(grads))

    def _record(self, step, variables, kept, reduced):
        for variable in variables:
            step.backend_state.summed.pop(variable.path, None)
        step.add(variables, kept, reduced)

    def _choose_dense_after(self, variables, grads):
        return (
            self.choose_dense
            and self._deferred is not None
            and any(
                isinstance(g, tf.IndexedSlices) and v.path not in self._slots
                for v, g in zip(variables, grads)
            )
        )

    # Slots -------------------------------------------------------------

    def _spec(self, variable, grad):
        sparse = self.sparse and variable.path not in self.dense_paths
        return _spec_of(grad, variable.shape, sparse)

    def _partial(self):
        strategy = self.strategy
        return strategy.num_replicas_in_sync > 1 and not reduces_in_step(strategy)

    def _ensure_slots(self, variables, grads):
        """Makes the slots that `variables` lack, for gradients like `grads`.

        In a replica's step of a `tf.distribute` strategy the slots are
        made once for all replicas, in its cross-replica context.
        """
        strategy, partial = self.strategy, self._partial()
        missing = []
        for variable, grad in zip(variables, grads):
            slot = self._slots.get(variable.path)
            if slot is None or slot.spec != self._spec(variable, grad):
                index_dtype = grad.indices.dtype if isinstance(grad, tf.IndexedSlices) else tf.int64
                missing.append((variable, self._spec(variable, grad), index_dtype))
        if not missing:
            return

        def create(*_):
            for variable, spec, index_dtype in missing:
                slot = self._slots.get(variable.path)
                if slot is None or slot.spec != spec:
                    self._slots[variable.path] = _Slot(
                        variable.path, spec, variable.shape, strategy, partial, index_dtype
                    )

        context = tf.distribute.get_replica_context()
        if tf.distribute.has_strategy() and context is not None:
            context.merge_call(create)
        else:
            create()

    def store(self, variables, grads, step=None):
        """Writes one `apply`'s unscaled gradients; makes missing slots.

        `tf.init_scope` lifts a slot made here out of the function being
        traced. With `every > 1` only steps 1, 1 + every, 1 + 2 * every, ...
        are written (counted by the keeper itself, so skipped loss-scale
        steps and gradient accumulation count as steps).

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
        reduced = reduces_in_step(self.strategy)
        if reduced:
            grads = all_reduce_sum(grads)
        self._ensure_slots(variables, grads)
        slots = [self._slots[v.path] for v in variables]

        # Under `deferring_sparse_writes`, sparse slots are written later.
        deferred = self._deferred
        here = [deferred is None or slot.indices is None for slot in slots]
        for slot, grad, now in zip(slots, grads, here):
            if not now:
                deferred.slots.append(slot)
                deferred.values.append(grad.values)
                deferred.indices.append(slot.cast_indices(grad.indices))

        if self.every == 1:
            writes = [
                slot.assign(grad) if now else [] for slot, grad, now in zip(slots, grads, here)
            ]
            return grads, reduced, writes

        def write():
            for slot, grad, now in zip(slots, grads, here):
                if now:
                    slot.assign(grad)
            self._written.assign(self._step)
            return tf.constant(True)

        wrote = tf.cond(step.backend_state.write_now, write, lambda: tf.constant(False))
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

        @tf.autograph.experimental.do_not_convert
        def compiled(data):
            with self.deferring_sparse_writes() as deferred:
                logs = step_function(data)
            return logs, deferred.tensors()

        compiled = tf.function(compiled, reduce_retracing=True, jit_compile=True)

        @tf.autograph.experimental.do_not_convert
        def step(data):
            logs, rows = compiled(data)
            self.write_deferred(rows)
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
        self.paths = self.trainable_paths = tuple(v.path for v in variables)

    def slot_variables(self):
        """Every `tf.Variable` the keeper holds (for tests and saving)."""
        out = []
        for path in self.paths or ():
            slot = self._slots[path]
            out.append(slot.values)
            if slot.indices is not None:
                out.append(slot.indices)
        return out
