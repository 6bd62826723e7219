"""The keeping mechanism on TensorFlow: the keeper, unscaling, slot writes.

Everything under `backend/tensorflow/` touches TensorFlow graph machinery
(tracing, `tf.Variable` slots, `tf.init_scope`, distribution): the slots
themselves are in `slots.py`, `tf.distribute` support in `distribute.py`,
sparse writes after an XLA step in `xla.py`, and the trainer mixin that
`KeepGradModel` derives from on this backend in `trainer.py`. `_capture.py`
brings each optimizer's gradients here.

Data path of one `optimizer.apply` in a training step:
`GradientKeeper.keep_from_optimizer` turns the gradients the step handed
over (computed from the scaled loss) into what the optimizer's update
receives (`unscale`), `store()` writes them into the slots (one assign per
variable; sparse gradients stay sparse; slots missing at the first trace
are made there), `after()` makes the optimizer's update of each variable
wait for its slot write, and readers densify on read. Under XLA, which
cannot write a variable whose shape changes, sparse slots are written after
the compiled step (`GradientKeeper.deferring_sparse_writes`), unless the
optimizer's update densifies the gradient anyway (`xla.densified_in`): then
the slot is dense and XLA computes the dense tensor once for both.
"""

import types

import tensorflow as tf

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad import _stats
from keras_keepgrad._capture import evaluation_step
from keras_keepgrad._capture import in_evaluation_step
from keras_keepgrad._capture import nest_by_path
from keras_keepgrad.backend import base
from keras_keepgrad.backend.tensorflow import distribute
from keras_keepgrad.backend.tensorflow import xla
from keras_keepgrad.backend.tensorflow.distribute import reduces_in_step
from keras_keepgrad.backend.tensorflow.replicas import BadReplicas
from keras_keepgrad.backend.tensorflow.slots import Slot
from keras_keepgrad.backend.tensorflow.slots import densify
from keras_keepgrad.backend.tensorflow.slots import map_both
from keras_keepgrad.backend.tensorflow.slots import map_values
from keras_keepgrad.backend.tensorflow.slots import on_read
from keras_keepgrad.backend.tensorflow.slots import spec_of

__all__ = [
    "GradientKeeper",
    "after",
    "current_step_gradients",
    "current_step_variables",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "nest_by_path",
    "reduces_in_step",
    "unscale",
]


def unscale(optimizer, variables, grads):
    """What the optimizer's update receives, from the scaled gradients.

    `_capture.unscale`, with `tf.IndexedSlices` gradients divided in their
    values (they stay sparse).
    """
    return _capture.unscale(optimizer, variables, grads, map_values=map_values)


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
            ordered.append(map_both(grad, tf.identity))
    return ordered


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
        summed.update(zip(todo, distribute.all_reduce_sum([step.grads[p] for p in todo])))
    return {path: summed[path] for path in step.grads}


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


class GradientKeeper(xla.DeferredSparseWrites, base.Keeper):
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

    Attributes: as `base.Keeper`'s.
    """

    def __init__(self, strategy, sparse=True, every=1, choose_dense=False):
        base.Keeper.__init__(self, every)
        xla.DeferredSparseWrites.__init__(self, choose_dense)
        self.strategy = strategy
        self.sparse = sparse
        self._slots = {}
        self._step = None  # counts steps, only with `every > 1`
        self._written = None  # `_step` at the last write, likewise
        self.bad_replicas = BadReplicas(strategy)

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
        state = step.backend_state
        self.bad_replicas.write(state, reduces_in_step(self.strategy), state.write_now)
        if self._step is not None:
            self._step.assign_add(1)

    def replica_flags(self):
        """As `base.Keeper.replica_flags`."""
        return self.bad_replicas.flags()

    def keep_from_optimizer(self, step, optimizer, variables, grads, apply):
        """As `base.Keeper.keep_from_optimizer`."""
        _check_unconditional(step, f"`{type(optimizer).__name__}.apply`")
        kept = unscale(optimizer, variables, grads)
        if self._choose_dense_after(variables, kept):
            # The update's own ops tell which sparse gradients it densifies:
            # trace it first, then make the slots (all writes under XLA,
            # where the order is XLA's).
            result = apply(distribute.agree_on_skip(optimizer, grads), kept)
            graph = tf.compat.v1.get_default_graph()
            self.dense_paths.update(xla.densified_in(graph, kept, variables))
            kept, reduced, _ = self.store(variables, kept, step)
        else:
            kept, reduced, writes = self.store(variables, kept, step)
            # Each slot write before the update of its variable: see `after`.
            passed = distribute.agree_on_skip(optimizer, after(writes, grads))
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
                result = apply(passed, kept)
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

    # Slots -------------------------------------------------------------

    def _spec(self, variable, grad):
        sparse = self.sparse and variable.path not in self.dense_paths
        return spec_of(grad, variable.shape, sparse)

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
                    self._slots[variable.path] = Slot(
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
        if step is not None:
            # Each replica's own share, before the all-reduce mixes them.
            self.bad_replicas.note(step.backend_state, grads)
        if reduced:
            grads = distribute.all_reduce_sum(grads)
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
                    **on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
                )
                self._written = tf.Variable(
                    tf.constant(-1, tf.int64),
                    name="kept_gradient/written",
                    **on_read(tf.VariableAggregation.ONLY_FIRST_REPLICA),
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
                slot = Slot(variable.path, spec, variable.shape, strategy)
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
