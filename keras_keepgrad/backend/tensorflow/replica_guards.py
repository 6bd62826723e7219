"""Guarding a skipped step's writes under a `tf.distribute` strategy of
several replicas (`MirroredStrategy`, `MultiWorkerMirroredStrategy`),
for `skipping.apply_if`; and what an optimizer's update writes.

A replica's step cannot hold its update in a `tf.cond`: the update's
`merge_call` is not allowed in one. The optimizer's update of the
variables by their gradients runs in one `tf.cond` where the replicas
meet; every other write to a replica's copy of a variable is guarded on
its own.
"""

import contextlib
import functools
import itertools
import threading

import keras
import tensorflow as tf

from keras_keepgrad import _compat
from keras_keepgrad.backend.tensorflow import distribute

__all__ = ["guarding_replica_writes", "of_keras", "replica_components", "written_variables"]


def of_keras(optimizer):
    """Whether `optimizer` is one of Keras's, whose update writes only its
    variables and those it updates, through their write methods."""
    return _of_keras_class(type(optimizer))


def _of_keras_class(cls):
    return cls.__module__.startswith("keras.")


def written_variables(optimizer, variables):
    """What an update of `variables` by `optimizer` can write: their and
    the optimizer's variables, as the `tf.Variable`s that hold them."""
    found = {}
    # Its EMA writes every variable it was built for, beyond those applied.
    built_for = _compat.optimizer_variables(optimizer)
    for variable in [*variables, *built_for, *optimizer.variables]:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        found[id(value)] = value
    return list(found.values())


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


def replica_components(optimizer, variables):
    """`[(component, replica)]`: each replica's copy of what an update can
    write (`written_variables`), under a `tf.distribute` strategy of several
    replicas, for the replicas in this process (`replica`: the index among
    them, `distribute.local_replica`).

    A replica's step cannot hold its update in a `tf.cond`: the update's
    `merge_call` is not allowed in one. The writes are guarded instead,
    each copy with its own replica's judgement (`guarding_replica_writes`),
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
    for value in written_variables(optimizer, variables):
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


# Per strategy and optimizer: the `_ReplicaGuard` of the update being traced.
_replica_guards = {}
_replica_guards_lock = threading.Lock()


@contextlib.contextmanager
def guarding_replica_writes(run, components, context, optimizer):
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
