"""The keeping mechanism on JAX: slots threaded through the jitted step.

On Keras's JAX backend a training step is a pure function,
`train_step(state, data) -> (logs, state)`, that `fit` jits and calls with
the model's state (trainable, non-trainable, optimizer and metrics
variables as arrays), donating the state's buffers to the call. The
optimizers update nothing in place: `optimizer.stateless_apply` returns
the new values.

Keeping follows that model. `_capture` hands this keeper the gradients
each `stateless_apply` (or a stateful `apply` inside a `StatelessScope`)
receives, while the step is traced; `unscale` turns them into what the
update receives. The training function is `step(state, slots, data) ->
(logs, state, kept)`: the kept gradients leave the jitted step as outputs,
next to the state, and the previous slots go in as donated inputs whose
buffers XLA reuses for them (so keeping holds one parameter-sized buffer,
not two). Between steps the keeper holds the slots as plain arrays, outside
the model's variables: they are never in `model.weights`, saved files or
exports. Under `jit`, their shapes and dtypes come from `jax.eval_shape`
of the real step, traced once before its first call. An eager step
(`run_eagerly=True`, or `jit_compile=False`) donates nothing: it is not
traced at all, and its first kept gradients become the slots.

Consequence of the donation: `model.gradients` are the slot arrays
themselves, valid until the next step that writes them starts. A reader
that needs them longer copies them (`np.asarray`), as the callbacks of this
package do.

When a callback asked for the per-step statistics (`_stats.require`),
the step that writes the slots also returns each kept gradient's sum of
squares (`shared_squares`, which XLA computes once with the gradient
metrics' own), and the keeper hands that small array to `_stats.store`
without reading it: callbacks fetch it in one transfer when they write.

No TensorFlow function runs here. Written against Keras 3.15's JAX trainer;
besides its public API it reads, through `_compat`, the variables a built
optimizer updates (what the values `stateless_apply` takes pair with), the
state's shardings and Keras's own step-function wrapper (as
`JAXTrainer.make_train_function` does).
"""

import functools
import types

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import StatelessScope
from keras import ops

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad import _stats
from keras_keepgrad._capture import evaluation_step
from keras_keepgrad._capture import in_evaluation_step
from keras_keepgrad._capture import nest_by_path
from keras_keepgrad._ops import tf_ops
from keras_keepgrad._squares import shared_squares
from keras_keepgrad.backend import base
from keras_keepgrad.backend.base import current_step_gradients
from keras_keepgrad.backend.base import current_step_updates
from keras_keepgrad.backend.base import densify
from keras_keepgrad.backend.base import unscale
from keras_keepgrad.backend.jax_replay import bad_devices
from keras_keepgrad.backend.jax_replay import devices_to_name
from keras_keepgrad.backend.jax_replay import replay_gradients

__all__ = [
    "GradientKeeper",
    "Trainer",
    "apply_if",
    "call_if",
    "current_step_gradients",
    "current_step_updates",
    "current_step_variables",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "make_train_function",
    "nest_by_path",
    "replay_gradients",
    "shared_squares",
    "tf_ops",
    "unscale",
]


def current_step_variables():
    """`{path: value after the update}` of what the step kept, else None.

    Only variables whose update the keeper saw (through an optimizer).
    """
    step = _capture.current_step()
    if step is None:
        return None
    return {path: after for path, (_, after) in step.backend_state.updates.items()}


class GradientKeeper(base.HostCountedKeeper):
    """Holds one model's kept gradients on JAX, keyed by variable path.

    The slots are arrays held by this object (not `keras.Variable`s), so
    they are never in `model.weights` or saved files. `make_train_function`
    threads them through the jitted step; the keeper counts the steps in
    Python, around the step, so the step itself has no side effects.

    Args:
        every: Positive int. Write the slots on steps 1, 1 + every, ...

    Attributes:
        paths: Paths of the variables the training function keeps, in
            `model.trainable_variables` order; `()` when its step passed
            no gradient to any optimizer; None before it was traced.
        trainable_paths: The model's trainable variable paths when it was
            traced.
        slots: The kept gradients, one array per path, or None.
        compiled_step: `compiled_step(write)`, the (jitted) step function
            that writes the slots or not, once the training function is
            made: for inspection, e.g. of its XLA cost.
    """

    def __init__(self, every=1):
        super().__init__(every)
        self.layouts = None
        self.compiled_step = None
        self._bad_devices = None
        # Why the step could not replay each device's rows, if it failed.
        self.replay_error = None

    # One training step (traced) -----------------------------------------

    def begin_step(self, step):
        step.backend_state = types.SimpleNamespace(updates={})

    def end_step(self, step):
        _capture.finish_step(self, step, update="optimizer.stateless_apply")

    def keep_from_stateless(self, step, optimizer, optimizer_variables, grads, values, apply):
        """Keeps what `optimizer.stateless_apply` receives, then runs it.

        Args:
            step: The current `_capture.Step`.
            optimizer: The optimizer whose `stateless_apply` was called.
            optimizer_variables: Its variables' values, as passed.
            grads: The gradients it was given (loss-scaled, if the loss
                was scaled).
            values: The trainable variables' values, as passed.
            apply: `apply(grads, kept)` runs the optimizer's own
                `stateless_apply` on `grads` (`kept`: as for
                `Keeper.keep_from_optimizer`).

        Returns:
            What `apply` returns.
        """
        variables = _compat.optimizer_variables(optimizer)
        mapping = list(zip(optimizer.variables, optimizer_variables))
        with StatelessScope(state_mapping=mapping):
            kept = unscale(optimizer, variables, grads)
        new_values, new_optimizer_variables = apply(grads, kept)
        step.add(variables, kept, True)
        for variable, before, after in zip(variables, values, new_values):
            step.backend_state.updates[variable.path] = (before, after)
        return new_values, new_optimizer_variables

    def keep_from_optimizer(self, step, optimizer, variables, grads, apply):
        """Keeps what a stateful `optimizer.apply` receives, then runs it.

        On JAX that is an `apply` inside a `StatelessScope` (which
        `stateless_apply` opens), or run eagerly.
        """
        kept = unscale(optimizer, variables, grads)
        before = [ops.convert_to_tensor(v) for v in variables]
        result = apply(grads, kept)
        step.add(variables, kept, True)
        for variable, value in zip(variables, before):
            step.backend_state.updates[variable.path] = (value, ops.convert_to_tensor(variable))
        return result

    def keep_given(self, step, variables, grads):
        """Keeps `grads` as given (a step without optimizer); returns them."""
        kept = [
            jnp.zeros(v.shape, dtype=v.dtype) if g is None else g for v, g in zip(variables, grads)
        ]
        step.add(variables, kept, True)
        for variable in variables:
            step.backend_state.updates.pop(variable.path, None)
        return list(grads)

    # Between steps ------------------------------------------------------

    def stepped(self, kept, bad_devices=None):
        """Counts one step; `kept` (or None) are its slots, if it wrote
        them, and `bad_devices` its `bad_devices`, if it replayed them."""
        if kept is not None:
            self.slots = list(kept)
            self._bad_devices = bad_devices
            self._written = self._steps
        self._steps += 1

    def replica_flags(self):
        """As `base.Keeper.replica_flags`: per device of `DataParallel`,
        whether its rows alone gave non-finite gradients (`bad_devices`)."""
        return None if self._bad_devices is None else np.asarray(self._bad_devices)

    def slot_dtypes(self):
        """`{path: dtype}` of the slots the training function writes."""
        return {path: slot.dtype for path, slot in zip(self.paths, self._slot_list())}

    def read(self):
        """`{path: array}` of the last kept step, in variable order.

        The arrays are the slots: the next step that writes donates them.
        """
        return dict(zip(self.paths, self._slot_list()))

    def _slot_list(self):
        if self.slots is None:
            raise RuntimeError("No training step wrote the kept gradients yet.")
        return self.slots

    def restore(self, variables, arrays, strategy=None):
        """Writes saved dense gradients (`{path: array}`) into the slots."""
        del strategy
        self.paths = self.trainable_paths = tuple(v.path for v in variables)
        self._bad_devices = None
        slots = []
        for variable in variables:
            value = jnp.asarray(arrays[variable.path])
            layout = (self.layouts or {}).get(variable.path)
            slots.append(value if layout is None else jax.device_put(value, layout))
        self.slots = slots

    def slot_variables(self):
        """Every array the keeper holds (for tests and saving)."""
        return list(self.slots or ())


def apply_if(run, apply, optimizer, variables, grads):
    """Runs `apply()` (a stateful `apply` of `grads`), then puts back the
    values it changed where `run` is false.

    On JAX a stateful `apply` runs eagerly or inside a `StatelessScope`
    (as `stateless_apply` opens it), where `run` is traced: the update's
    values are selected, not branched on.
    """
    del grads
    _capture.build_as_apply(optimizer, variables)
    # Its EMA writes every variable it was built for, beyond those applied.
    built_for = _compat.optimizer_variables(optimizer)
    tracked = list({id(v): v for v in [*variables, *built_for, *optimizer.variables]}.values())
    before = [v.value for v in tracked]
    result = apply()
    for variable, value in zip(tracked, before):
        variable.assign(jnp.where(run, variable.value, value))
    return result


def call_if(flag, fn, tensors, rows=()):
    """Runs `fn({name: np.ndarray})` on the host where `flag` is true: a
    `jax.debug.callback` in a branch of a `jax.lax.cond`, so that the
    tensors leave the device only where `flag` holds (`_evidence`).
    `rows` matter only under a `tf.distribute` strategy: the jitted step
    holds the whole batch, on every device count."""
    del rows

    def host(arrays):
        fn({name: np.asarray(value) for name, value in arrays.items()})

    def run(arrays):
        jax.debug.callback(host, arrays)

    jax.lax.cond(flag, run, lambda arrays: None, dict(tensors))


def _zeros_like(shapes, layouts):
    slots = []
    for shape, layout in zip(shapes, layouts):
        zeros = jnp.zeros(shape.shape, shape.dtype)
        slots.append(zeros if layout is None else jax.device_put(zeros, layout))
    return slots


def make_train_function(model):
    """Sets `model.train_function` to a step that keeps the gradients.

    As Keras 3.15's `JAXTrainer.make_train_function`, with the slots added
    to what the (jitted, donating) step takes and returns.
    """
    keeper = model._keeper
    distributed = keras.distribution.distribution() is not None
    state_shardings = _compat.state_sharding_spec(model) if distributed else None
    if distributed:
        # Each slot takes its variable's layout (replicated under
        # `DataParallel`, sharded as the variable under `ModelParallel`).
        sharding = {v.path: v.value.sharding for v in model.trainable_variables}
    keeper.layouts = dict(sharding) if distributed else {}
    jitted = not model.run_eagerly and model.jit_compile
    # A callback asks before `fit` makes the training function.
    statistics = _stats.requested(model)

    def step_body(state, slots, data, write):
        del slots  # donated: XLA writes the new slots into their buffers
        with _capture.training_step(model, keeper) as step:
            logs, new_state = model.train_step(state, data)
        if not write:
            return logs, new_state
        kept = [densify(step.grads[path]) for path in keeper.paths]
        # What describes the step the slots hold is written with them.
        extras = {}
        if statistics:
            extras["squares"] = shared_squares(dict(zip(keeper.paths, kept)))
        # Replayed already where the step saved its batch (`_skipping`).
        flags = getattr(step.backend_state, "bad_devices", None)
        if flags is None:
            finite = jnp.all(jnp.isfinite(shared_squares(dict(enumerate(kept)))))
            flags = model._bad_devices((state, data), finite)
        if flags is not None:
            extras["bad_devices"] = flags
        return logs, new_state, kept, extras

    functions = {}

    def compiled(write):
        function = functions.get(write)
        if function is None:
            function = functools.partial(step_body, write=write)
            if jitted:
                out_shardings = None
                if distributed:
                    slot_shardings = [keeper.layouts[p] for p in keeper.paths]
                    out_shardings = (None, state_shardings)
                    if write:
                        out_shardings += (slot_shardings, None)
                # `keep_unused`: the old slots are not read, only donated,
                # and an unused argument would be dropped with its buffer.
                function = jax.jit(
                    function,
                    donate_argnums=(0, 1),
                    keep_unused=True,
                    out_shardings=out_shardings,
                )
            functions[write] = function
        return function

    keeper.compiled_step = compiled

    def train_step(state, data):
        try:
            return run_step(state, data)
        except BaseException:
            _reattach(model, state)
            raise

    def run_step(state, data):
        _compat.follow_state_shardings(model, state)
        write = keeper.writes_next()
        if jitted and (keeper.slots is None or len(keeper.slots) != len(keeper.paths or ())):
            # The first jitted step donates slots, which must exist before
            # it: their shapes and dtypes are those of the gradients the
            # traced step keeps. An eager step donates nothing and is not
            # traced for them (its `call`s run on arrays, as many times as
            # in Keras): its first kept gradients become the slots.
            shapes = jax.eval_shape(functools.partial(step_body, write=True), state, None, data)[2]
            keeper.slots = _zeros_like(shapes, [keeper.layouts.get(p) for p in keeper.paths])
        extras = {}
        if write:
            logs, state, kept, extras = compiled(True)(state, keeper.slots, data)
        else:
            logs, state = compiled(False)(state, None, data)
            kept = None
        keeper.stepped(kept, extras.get("bad_devices"))
        if "squares" in extras:
            _stats.store(model, keeper.paths, extras["squares"])
        return logs, state

    model.train_function = _compat.make_function(model, train_step)


def _reattach(model, state):
    """Gives `model`'s variables the values of `state`, a step's input.

    Keras's `fit` detaches the variables from their values while its steps
    run (`_purge_model_variables`) and attaches the last step's output at
    the end: a step that raises (a gradient metric's error, raised as the
    step is traced) would leave them with none. Its input is what they held
    before it; a buffer that the step donated is gone, and left as it is.
    """
    arrays = jax.tree_util.tree_leaves(state)
    if any(isinstance(a, jax.Array) and a.is_deleted() for a in arrays):
        return
    trainable, non_trainable, optimizer_values, metrics_values = state
    for variables, values in (
        (model.trainable_variables, trainable),
        (model.non_trainable_variables, non_trainable),
        (model.optimizer.variables, optimizer_values),
        (model.metrics_variables, metrics_values),
    ):
        for variable, value in zip(variables, values):
            variable.assign(value)


class Trainer(base.Trainer):
    """`KeepGradModel` on JAX: the slots threaded through the jitted step."""

    # The optimizer, built for the old variables, refuses a rebuilt
    # training function: only `compile` makes a new one.
    _stale_fix = ""

    def _new_keeper(self):
        return GradientKeeper(every=self._keep_every)

    def _make_keeping_train_function(self, force):
        return make_train_function(self)

    def _skip_state_in(self, args, variables):
        # The step is pure: the metrics' values come in its `state`.
        metrics_values = args[0][3]
        index = {id(v): i for i, v in enumerate(self.metrics_variables)}
        return [metrics_values[index[id(v)]] for v in variables]

    def _step_data(self, args):
        return args[1]

    def _bad_devices(self, args, finite):
        # Once per step, where both the saved batch and the step ask.
        backend_state = getattr(_capture.current_step(), "backend_state", None)
        if getattr(backend_state, "bad_devices", None) is not None:
            return backend_state.bad_devices
        state, data = args
        count = devices_to_name(self)
        if count == 1:
            return None
        try:
            flags = bad_devices(self, state, data, finite, count)
        except (TypeError, ValueError) as error:
            # A model that cannot run on one device's rows (a fixed batch
            # size, a stateful RNN) trains on; reading says why.
            self._keeper.replay_error = error
            return None
        if backend_state is not None:
            backend_state.bad_devices = flags
        return flags

    def _skip_state_out(self, result, pairs, logs):
        step_logs, state = result
        trainable, non_trainable, optimizer_values, metrics_values = state
        metrics_values = list(metrics_values)
        index = {id(v): i for i, v in enumerate(self.metrics_variables)}
        for variable, value in pairs:
            metrics_values[index[id(variable)]] = value
        if isinstance(step_logs, dict):
            step_logs = {**step_logs, **logs}
        return step_logs, (trainable, non_trainable, optimizer_values, metrics_values)

    def _restores_state_on_error(self):
        # Steps are pure, and `_reattach` puts back what a raising step took.
        return False
