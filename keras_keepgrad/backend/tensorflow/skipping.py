"""Skipping a bad step's update on TensorFlow (`_skipping`): guarded writes,
or a `tf.cond`; under `MirroredStrategy`, each replica's copies' writes.

Also the host side of a skipped step's evidence (`_evidence`): `call_if`,
and `replay_gradients`.
"""

import contextlib
import functools
import itertools
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad.backend.tensorflow import distribute

__all__ = ["apply_if", "call_if", "deferring_host_calls", "host_cond", "replay_gradients"]

# The open `deferring_host_calls` blocks' lists (XLA steps being traced).
_deferred = []


def apply_if(run, apply, optimizer, variables, grads):
    """Runs `apply()` (the optimizer's `apply` of `grads`) where `run` is
    true.

    Where it can (`_guardable`), each write of the update is guarded as it
    happens (`_guarding_writes`); else the update is traced into a branch
    of a `tf.cond`, so a skipped step runs none of its ops. An eager step
    runs the branch. In a replica's step of a strategy with several
    replicas, each write to a replica's copy of a variable is guarded
    (`_guarding_replica_writes`).
    """
    # Outside the branch: a `tf.cond` cannot create the optimizer's variables.
    _capture.build_as_apply(optimizer, variables)
    context = distribute.shared_context()
    if context is not None:
        written = _replica_components(optimizer, variables)
        with _guarding_replica_writes(run, written, context, optimizer):
            return apply()
    if not tf.executing_eagerly():
        guarded = _guardable(optimizer, variables, grads)
        if guarded is not None:
            step = _capture.current_step()
            select = step is not None and step.model.jit_compile
            with _guarding_writes(run, guarded, select):
                return apply()

    def applied():
        apply()
        return tf.constant(True)

    tf.cond(run, applied, lambda: tf.constant(False))


def _guardable(optimizer, variables, grads):
    """The `tf.Variable`s of `variables` and of `optimizer`'s state, if its
    update's writes can be guarded one by one (`_guarding_writes`); else
    None.

    Only Keras's own optimizers, which write nothing but their variables
    and those they update, through `assign`, `assign_add` and
    `assign_sub`, and dense gradients (a sparse one is written row by row,
    `scatter_*`) qualify; a `LossScaleOptimizer` branches itself.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    if not _of_keras(optimizer):
        return None
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return None
    written = _written(optimizer, variables)
    for value in written:
        if not isinstance(value, tf.Variable) or isinstance(value, tf.distribute.DistributedValues):
            return None
    return written


def _of_keras(optimizer):
    """Whether `optimizer` is one of Keras's, whose update writes only its
    variables and those it updates, through their write methods."""
    return _of_keras_class(type(optimizer))


def _of_keras_class(cls):
    return cls.__module__.startswith("keras.")


def _written(optimizer, variables):
    """What an update of `variables` by `optimizer` can write: their and
    the optimizer's variables, as the `tf.Variable`s that hold them."""
    written = {}
    # Its EMA writes every variable it was built for, beyond those applied.
    built_for = _compat.optimizer_variables(optimizer)
    for variable in [*variables, *built_for, *optimizer.variables]:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        written[id(value)] = value
    return list(written.values())


# What a subclass of a Keras optimizer may override and still be skipped
# under a strategy: `update_step` runs inside the branch around the whole
# update; the others run before any step, or never in one.
_OWN_METHODS = ("__init__", "build", "update_step", "get_config", "from_config")


def _overridden(optimizer):
    """The names of the members of Keras's optimizer that `optimizer`'s
    own classes (its subclasses of Keras's) define, bar `_OWN_METHODS`."""
    keras_base = _compat.tf_optimizer_class()
    allowed = _OWN_METHODS
    if not hasattr(keras_base, "_distributed_tf_update_step"):
        # No update to hold in one branch: `update_step` writes unguarded.
        allowed = tuple(n for n in allowed if n != "update_step")
    # The classes below Keras's (TensorFlow's trackables come after it).
    own = list(itertools.takewhile(lambda c: not _of_keras_class(c), type(optimizer).__mro__))
    return sorted(
        {
            n
            for c in own
            for n in vars(c)
            if n not in allowed and hasattr(keras_base, n) and not _dunder(n)
        }
    )


def _dunder(name):
    """Class bookkeeping (`__module__`, `__doc__`...), not a method."""
    return name.startswith("__") and name.endswith("__") and name != "__init__"


def _replica_components(optimizer, variables):
    """`[(component, replica)]`: each replica's copy of what an update can
    write (`_written`), under a `tf.distribute` strategy of several
    replicas, for the replicas in this process (`replica`: the index among
    them, `distribute.local_replica`).

    A replica's step cannot hold its update in a `tf.cond`: the update's
    `merge_call` is not allowed in one. The writes are guarded instead,
    each copy with its own replica's judgement (`_guarding_replica_writes`),
    but those of the update of the variables by their gradients (the
    optimizer's `update_step`), which one `tf.cond` holds where the
    replicas meet. That needs every other write to go through the copies'
    `assign`, `assign_add`, `assign_sub`, `scatter_update`, `scatter_add`
    or `scatter_sub` (`_GUARDED_METHODS`), as Keras's own optimizers' do:
    an optimizer of Keras's, or a subclass that changes nothing but
    `update_step` and what runs before any step (`_OWN_METHODS`).

    Raises:
        ValueError: `optimizer` is not such an optimizer, or something it
            writes is not a variable of the strategy.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for each in (optimizer, inner):
        overridden = _overridden(each)
        if overridden:
            raise ValueError(
                "Under a `tf.distribute` strategy with several replicas, "
                "`skip_bad_steps` skips the updates of Keras's own optimizers "
                "and of subclasses that override only "
                f"{', '.join(f'`{n}`' for n in _OWN_METHODS)} (it holds "
                "`update_step` in one branch and guards each other write "
                "Keras's optimizer makes to its variables). Received: "
                f"optimizer of type {type(each).__qualname__} from "
                f"{type(each).__module__!r}, which overrides "
                f"{', '.join(f'`{n}`' for n in overridden)}. Override only "
                "those, train on one replica, or set "
                "`model.skip_bad_steps = None`."
            )
    strategy = tf.distribute.get_strategy()
    components = []
    for value in _written(optimizer, variables):
        if not isinstance(value, tf.distribute.DistributedValues):
            raise ValueError(
                f"Variable {value.name!r} is written by the update of "
                f"{type(optimizer).__name__} but is not a variable of the "
                f"model's {type(strategy).__name__}: it was made outside "
                "`strategy.scope()`. Make the model and its optimizer in "
                "the strategy's scope."
            )
        components.extend(
            (copy, replica)
            for replica, copy in enumerate(strategy.experimental_local_results(value))
        )
    return components


@contextlib.contextmanager
def _guarding_writes(run, variables, select):
    """While open, each write to `variables` (`tf.Variable`s) happens only
    where `run` is true: a skipped update leaves every bit as it was; an
    applied one writes what it would have written.

    A branch around the whole update makes every op of it wait for the
    judgement, even those that read no gradient: it cost the 1M-parameter
    MLP's graph step about 2.5 points more than guarding each write
    (`benchmarks/`). Guarded one by one, only the writes wait: each in a
    `tf.cond` of its own. Under XLA
    (`select`), which turns a branch into a selection of each variable's
    new or old value after it (and an update that reads a moment it has
    updated, as Adam does, then copies every moment's old value, each
    step), each write selects `tf.where(run, new, old)` as it happens.
    """

    def guarding(variable):
        assign = variable.assign
        methods = (assign, variable.assign_add, variable.assign_sub)
        combines = (lambda old, value: value, tf.add, tf.subtract)

        def guard(method, combine):
            def write(value, use_locking=None, name=None, read_value=True):
                value = tf.convert_to_tensor(value, variable.dtype)
                if select:
                    old = variable.read_value()
                    return assign(tf.where(run, combine(old, value), old), read_value=read_value)

                def written():
                    method(value, read_value=False)
                    return tf.constant(True)

                tf.cond(run, written, lambda: tf.constant(False))
                return variable if read_value else None

            return write

        return [guard(m, c) for m, c in zip(methods, combines)]

    for variable in variables:
        variable.assign, variable.assign_add, variable.assign_sub = guarding(variable)
    try:
        yield
    finally:
        for variable in variables:
            del variable.assign, variable.assign_add, variable.assign_sub


# Per strategy and optimizer: the `_ReplicaGuard` of the update being traced.
_replica_guards = {}
_replica_guards_lock = threading.Lock()


@contextlib.contextmanager
def _guarding_replica_writes(run, components, context, optimizer):
    """While open, each write to a replica's copy in `components`
    (`[(tf.Variable, replica index)]`) happens only where that replica's
    `run` is true.

    Every replica's step in this process opens it, with its own `run`
    (one value on every replica: it judges the global gradients). The
    copies are written where the replicas' updates meet (`merge_call`),
    once every replica has opened it, or in a replica's own step for its
    own copy (a variable without aggregation, such as a
    `LossScaleOptimizer`'s counter). The first replica to open it guards
    every copy; the last to leave, or the first to raise, restores them.
    """
    key = (id(context.strategy), id(optimizer))
    with _replica_guards_lock:
        guard = _replica_guards.setdefault(key, _ReplicaGuard(components, optimizer))
        guard.runs[distribute.local_replica(context)] = run
        guard.open += 1
        first = guard.open == 1
    if first:
        guard.install()
    raised = True
    try:
        yield
        raised = False
    finally:
        with _replica_guards_lock:
            guard.open -= 1
            # A replica that raised ends the trace: nothing is left guarded.
            last = (guard.open == 0 or raised) and _replica_guards.get(key) is guard
            if last:
                del _replica_guards[key]
        if last:
            guard.remove()


_GUARDED_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "scatter_update",
    "scatter_add",
    "scatter_sub",
)


class _ReplicaGuard:
    """Guards the writes of one update under a strategy, every replica's.

    Each write to a replica's copy is in a `tf.cond` of its own
    (`_guard_copy`), but those of the optimizer's update of the variables
    by their gradients, the bulk, which one `tf.cond` holds where the
    replicas' updates meet. With a `tf.cond` per write, skipping cost a
    1M-parameter MLP's step under `MirroredStrategy` 6.5 points more than
    so (`benchmarks/`, one run of 2 processes).

    Args:
        components: `[(copy, replica index)]` to guard.
        optimizer: The optimizer whose `apply` it is.
    """

    def __init__(self, components, optimizer):
        self.components = components
        # The optimizer that runs the update (a `LossScaleOptimizer`'s inner
        # one), and Keras's private method of it that the replicas' updates
        # meet in; without it, each write is guarded alone.
        self.updater = getattr(optimizer, "inner_optimizer", optimizer)
        self.update = getattr(type(self.updater), "_distributed_tf_update_step", None)
        self.runs = {}  # `{replica index: run}`
        self.open = 0
        self.whole = False  # inside the `tf.cond` around the whole update

    def run(self, replica):
        """Replica `replica`'s judgement: whether its update runs."""
        if replica not in self.runs:
            raise RuntimeError(
                f"Replica {replica}'s copy of a variable was written before "
                "its step judged its gradients."
            )
        return self.runs[replica]

    def install(self):
        """Guards every copy's writes and holds the update in one branch."""
        for variable, index in self.components:
            _guard_copy(variable, functools.partial(self.run, index), self)
        if self.update is not None:
            self.updater._distributed_tf_update_step = self._update_step

    def remove(self):
        """Restores every copy's write methods and the optimizer's update."""
        for variable, _ in self.components:
            for name in _GUARDED_METHODS:
                variable.__dict__.pop(name, None)
        self.updater.__dict__.pop("_distributed_tf_update_step", None)

    def _update_step(self, distribution, grads_and_vars, learning_rate):
        def applied():
            self.whole = True
            try:
                self.update(self.updater, distribution, grads_and_vars, learning_rate)
            finally:
                self.whole = False
            return tf.constant(True)

        # Where the replicas meet, every replica's `run` is the same.
        tf.cond(self.run(0), applied, lambda: tf.constant(False))


def _guard_copy(variable, run_of, guard):
    """Guards each write method of `variable` (one replica's copy): in a
    `tf.cond` of `run_of()`, returning what the method returns; as it is
    inside the `tf.cond` around the whole update (`guard.whole`)."""

    def guarded(method, reads):
        def write(value, *args, **kwargs):
            if guard.whole:
                return method(value, *args, **kwargs)
            read_value = kwargs.pop("read_value", True) if reads else True

            def written():
                if reads:
                    kwargs["read_value"] = False
                method(value, *args, **kwargs)
                return tf.constant(True)

            done = tf.cond(run_of(), written, lambda: tf.constant(False))
            # What the method returns (the op, or the new value): the
            # strategy groups what each copy's write returns.
            if not read_value:
                return done.op
            with tf.control_dependencies([done]):
                return variable.read_value()

        return write

    for name in _GUARDED_METHODS:
        # The class's method: never a guard left by another trace.
        method = getattr(type(variable), name).__get__(variable)
        setattr(variable, name, guarded(method, name.startswith("assign")))


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


def call_if(flag, fn, tensors, rows=()):
    """Runs `fn({name: np.ndarray})` on the host where `flag` is true.

    Eager: a Python `if`. Graph: a `tf.cond` around a `tf.numpy_function`,
    so the tensors leave the device only where `flag` holds. In an XLA step
    (`deferring_host_calls`) that `tf.cond` follows the XLA program.

    In a replica's step of a strategy with several replicas, `fn` runs
    once for all of them, where they meet (`merge_call`): the tensors
    named in `rows` (each replica's share of the batch) are concatenated
    in replica order, which is the order in which the strategy split the
    batch; the others (the same on every replica) are replica 0's. With
    replicas in other worker processes (`MultiWorkerMirroredStrategy`),
    the rows are gathered from every worker (a collective each worker's
    branch joins: `flag` is the same on all) and `fn` runs on the chief
    only (`strategy.extended.should_checkpoint`), as a checkpoint is
    written by the chief.
    """
    names = list(tensors)
    values = [tensors[n] for n in names]
    context = distribute.shared_context()
    if context is not None:

        def merged(strategy, flag, *values):
            local = strategy.experimental_local_results
            if distribute.reduces_in_step(strategy):

                def rows_of(v):
                    return strategy.gather(v, axis=0)
            else:

                def rows_of(v):
                    return tf.concat(local(v), 0)

            def joined():
                return [rows_of(v) if n in rows else local(v)[0] for n, v in zip(names, values)]

            chief = strategy.extended.should_checkpoint
            host_cond(local(flag)[0], names, joined, fn if chief else lambda arrays: None)

        context.merge_call(merged, args=(flag, *values))
        return
    if tf.executing_eagerly():
        if bool(flag):
            fn({n: np.asarray(v) for n, v in zip(names, values)})
        return
    if _deferred:
        _deferred[-1].append((flag, names, values, fn))
        return
    host_cond(flag, names, values, fn)


def host_cond(flag, names, values, fn):
    """The graph part of `call_if`. `values`: tensors, or a function that
    returns them, called in the branch."""

    def host(*arrays):
        fn(dict(zip(names, arrays)))
        return np.bool_(True)

    def run():
        tensors = values() if callable(values) else values
        return tf.reshape(tf.numpy_function(host, tensors, tf.bool, stateful=True), [])

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
