"""What every backend implements: the `Keeper` interface and the trainer mixin.

A backend module (`backend/tensorflow/`, `backend/jax.py`,
`backend/torch.py`) provides a `GradientKeeper`, a subclass of `Keeper`
below, and a `Trainer`, a subclass of `Trainer` below that `KeepGradModel`
derives from (as `keras.Model` derives from the backend's Keras trainer).
`backend/__init__.py` picks the running backend's once.

The helpers here are the reading side of a step that JAX and PyTorch share;
TensorFlow's differ (sparse gradients, replicas) and are defined there.
"""

import itertools

import keras
from keras import ops

from keras_keepgrad import _capture

__all__ = [
    "HostCountedKeeper",
    "Keeper",
    "Trainer",
    "current_step_gradients",
    "current_step_updates",
    "densify",
    "unscale",
]

_KEEPER_SERIALS = itertools.count()


class Keeper:
    """Holds one model's kept gradients, keyed by variable path.

    `_capture` hands a keeper the gradients of every optimizer update in a
    `KeepGradModel`'s training step (`keep_from_optimizer`), or the ones a
    step passes to `keep_step_gradients` (`keep_given`), between
    `begin_step` and `end_step`. Between steps, readers call `read`,
    `slot_dtypes` and `last_write`; saving calls `restore` and
    `slot_variables`.

    Args:
        every: Positive int. Slots are written on steps 1, 1 + every, ...

    Attributes:
        every: Positive int, as given.
        paths: Paths of the variables the training function keeps, in
            `model.trainable_variables` order; `()` when its step passed
            no gradient to any optimizer; None before its first (or, on
            TensorFlow, traced) step.
        trainable_paths: The model's trainable variable paths at that step
            (the kept gradients are stale once they change).
        ran_a_step: Whether a step (run or traced) ran to its end.
        record_updates: Bool. Also record each update's values before and
            after (`current_step_updates`), for `UpdateRatio` (PyTorch).
    """

    def __init__(self, every=1):
        self.every = every
        self.paths = None
        self.trainable_paths = None
        self._serial = next(_KEEPER_SERIALS)  # tells keepers apart in `last_write`
        self._warned_missing = False
        self.ran_a_step = False
        self.record_updates = False

    @property
    def built(self):
        return self.paths is not None

    @property
    def kept_nothing(self):
        """Whether the last (traced) step had trainable variables but kept nothing."""
        return self.paths == () and bool(self.trainable_paths)

    # One training step (run or traced) ----------------------------------

    def begin_step(self, step):
        """Before the model's `train_step`: sets `step.backend_state`."""
        raise NotImplementedError

    def end_step(self, step):
        """After the model's `train_step`: which variables it kept
        (`_capture.finish_step`), and the slots of a step that writes them."""
        raise NotImplementedError

    def keep_from_optimizer(self, step, optimizer, variables, grads, apply):
        """Keeps what `optimizer.apply` receives, then runs `apply`.

        Args:
            step: The current `_capture.Step`.
            optimizer: The optimizer whose `apply` was called.
            variables: The variables it updates.
            grads: The gradients it was given (loss-scaled, if the loss
                was scaled).
            apply: `apply(grads, kept)` runs the optimizer's own `apply` on
                `grads`; `kept` are the gradients as kept, which decide
                whether it runs where the model skips bad steps.

        Returns:
            What `apply` returns.
        """
        raise NotImplementedError

    def keep_given(self, step, variables, grads):
        """Keeps `grads` as given (a step without optimizer); returns the
        gradients to update the variables with."""
        raise NotImplementedError

    # Between steps ------------------------------------------------------

    def read(self):
        """`{path: dense tensor}` of the last kept step, in variable order."""
        raise NotImplementedError

    def slot_dtypes(self):
        """`{path: dtype}` of the kept gradients."""
        raise NotImplementedError

    def last_write(self):
        """`(write, age)`: which write the slots hold, and from how long ago.

        `age` is the number of training steps run since the one whose
        gradients the slots hold (0: the last step's). `write` identifies
        that write (equal values: the same gradients), or is None where
        every step writes (`keep_every=1`) and the slots always hold the last
        step's. Also `(None, 0)` before any step.
        """
        raise NotImplementedError

    def has_sparse_slots(self):
        """Whether some slot holds a sparse gradient as (values, indices)."""
        raise NotImplementedError

    def replica_flags(self):
        """Bool array, per replica: whether its partial gradients of the
        kept step were not finite; None where the step has no such record
        (one replica, or replicas whose partial gradients never exist)."""
        return None

    def restore(self, variables, arrays, strategy=None):
        """Writes saved dense gradients (`{path: array}`) into the slots."""
        raise NotImplementedError

    def slot_variables(self):
        """Every variable, array or tensor the keeper holds (for tests and saving)."""
        raise NotImplementedError


class HostCountedKeeper(Keeper):
    """What the JAX and PyTorch keepers share: their steps are counted in
    Python, around the step, and their slots are held by the keeper.

    Attributes:
        slots: The kept gradients, or None.
    """

    def __init__(self, every=1):
        super().__init__(every)
        self.slots = None
        self._steps = 0
        self._written = -1

    def has_sparse_slots(self):
        """Gradients here are dense: never."""
        return False

    def writes_next(self):
        """Whether the next step writes the slots (steps 1, 1 + every, ...)."""
        return self._steps % self.every == 0

    def last_write(self):
        """`(write, age)`, as `Keeper.last_write`."""
        if self.every == 1 or self._written < 0:
            return None, 0
        return (self._serial, self._written), self._steps - 1 - self._written


def unscale(optimizer, variables, grads):
    """What the optimizer's update receives (`_capture.unscale`).

    On JAX, reads the optimizer's variables as the enclosing
    `StatelessScope` maps them.
    """
    return _capture.unscale(optimizer, variables, grads)


def densify(grad):
    """The gradient as a tensor (JAX and PyTorch gradients are dense)."""
    return ops.convert_to_tensor(grad)


def global_gradients(step, kept, passed):
    """What `step` is judged by (`_skipping`): `kept`, one `apply`'s kept
    gradients, already the global ones on JAX (under a `keras.distribution`
    the step computes on global arrays) and PyTorch."""
    del step, passed
    return kept


def current_step_gradients():
    """The `{path: grad}` kept so far in the training step being run, else None.

    On JAX, under a `keras.distribution` the step computes on global
    arrays, so these are the global batch's gradients.
    """
    step = _capture.current_step()
    return None if step is None else step.grads


def current_step_updates():
    """`{path: (value before, value after)}` of the step's optimizer updates.

    On PyTorch, recorded only where the keeper was asked to
    (`record_updates`, for `UpdateRatio`): the value before is a copy.
    """
    step = _capture.current_step()
    return None if step is None else step.backend_state.updates


class Trainer:
    """The backend's part of `KeepGradModel`, before `keras.Model` in its bases.

    Each hook's default here is what a backend without that concern does;
    the backends' `Trainer`s override what differs.
    """

    # `model.make_train_function(force=True)` rebuilds a stale training
    # function (on JAX only `compile` does).
    _stale_fix = ", or `model.make_train_function(force=True)`"

    @property
    def jit_compile(self):
        """Bool. Whether the training step is compiled with XLA.

        Under a `tf.distribute` strategy with several replicas XLA cannot
        compile Keras's step (it reads each replica's variables from one
        device), so `True` falls back to `False` with a warning. On PyTorch,
        `True` (`torch.compile`) is refused while the model keeps gradients.
        """
        if self._compiles_step_inside():
            return False
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        keras.Model.jit_compile.fset(self, self._checked_jit_compile(value))

    def _compiles_step_inside(self):
        """True only while the backend compiles the step itself, inside the
        training function Keras makes (which must then not compile it)."""
        return False

    def _init_backend_state(self):
        """Called at the end of `KeepGradModel.__init__`."""

    def _new_keeper(self):
        """A keeper with no slots yet, set up for how the model trains."""
        raise NotImplementedError

    def _make_keeping_train_function(self, force):
        """The keeping training function, once the keeper is made.

        The backend's own `make_train_function` (Keras's), unless the
        backend makes its own.
        """
        return super().make_train_function(force=force)

    def _restores_state_on_error(self):
        """Whether a step that raises leaves state that must be put back.

        A traced step raises while it is traced, before anything runs;
        eager steps have updated the variables by then.
        """
        return True

    def _checked_jit_compile(self, value):
        """The `jit_compile` to set for `value`: may warn and fall back, or raise."""
        return value

    def _check_keeping_allowed(self):
        """Raises, before anything changes, if the model cannot keep as compiled."""

    def _check_compile_arguments(self, args, kwargs):
        """Raises, before `compile` changes anything, on arguments that
        keeping does not support."""

    def _compile_config_made_elsewhere(self, config, what):
        """`compile` arguments made elsewhere (a loaded file, a model that
        `keep_gradients()` wraps), adapted to what keeping supports."""
        return config

    def _step_data(self, args):
        """The batch (`data`) of a training step called with `args`."""
        return args[0]

    def _bad_devices(self, args, finite):
        """Bool per device whose rows alone went non-finite, in a step
        called with `args` whose kept gradients are `finite` (a bool
        tensor): where the devices' partial gradients never exist apart
        but can be replayed (JAX `DataParallel`); else None."""
        del args, finite

    def _strategy_refuses_skipping(self):
        """Why the model's distribution strategy cannot skip bad steps
        (`skip_bad_steps`), or None."""
        return None

    def _skip_state_in(self, args, variables):
        """The values of `variables` (the state of `skip_bad_steps`) as the
        step with arguments `args` begins."""
        del args
        return [ops.convert_to_tensor(v) for v in variables]

    def _skip_state_out(self, result, pairs, logs):
        """The step's `result`, with `(variable, new value)` `pairs` written
        and `logs` (`{key: value}`) added to its logs."""
        for variable, value in pairs:
            variable.assign(value)
        if isinstance(result, dict):
            result = {**result, **logs}
        return result

    def _module_attribute(self, name):
        """An attribute the backend's module machinery holds outside
        `__dict__`; AttributeError if none."""
        raise AttributeError(name)
