"""The keeping mechanism on PyTorch: the gradients `apply` receives, held.

On Keras's PyTorch backend a training step runs eagerly, in Python:
Keras's `train_step` calls `self.zero_grad()` (which sets every
parameter's `.grad` to None), the scaled loss's `backward()`, reads each
variable's `v.value.grad` and calls `optimizer.apply(grads, variables)`
under `torch.no_grad()`. (With `jit_compile=True` Keras hands the step
to `torch.compile`; everything here still runs eagerly, outside what it
compiles: see `_torch_compile`.)

Keeping follows that model. `_capture` hands this keeper the gradients
each `optimizer.apply` receives (a `LossScaleOptimizer`'s inner `apply` is
not counted twice); `_capture.unscale` turns them into what the update
receives. The keeper holds those values, detached, outside Keras's
variables: never in `model.weights`, saved files or exports.

On a step that writes the slots, a gradient the optimizer receives as it
is (no loss scale to divide out) is copied: one parameter-sized write, the
same as on the other backends. So the kept value is what the update
received whatever later writes the parameter's `.grad` in place
(`zero_grad(set_to_none=False)`, an accumulating `backward()`), and a
tensor read from `model.gradients` never changes afterwards. Unscaled
gradients are new tensors already and are not copied again.

When to copy was measured (`benchmarks/run.py keeping --backend torch`, the 1M MLP
with Adam): copying right after `apply` costs what a bare copy of the
gradients costs, while copying before it, or holding the `.grad` tensors
themselves, added several percent more. But only a copy made before
`apply` is sure to hold what it received, should the update write its
gradients in place (Keras's own optimizers only read them). So an
optimizer's first step is copied before its update, and PyTorch's version
counter of each gradient (`tensor._version`, which every in-place write
increments) tells whether the update wrote it; if not, its later steps are
copied after, each checked the same way. An update that wrote a gradient
after earlier ones had not raises, rather than keeping a value it did not
receive.

When a callback asked for the per-step statistics (`_stats.require`), a
step that writes the slots hands `_stats.store` each kept gradient's sum
of squares: the tensor the step's gradient metrics computed already
(`shared_squares` matches the same gradients), else computed once here,
left on its device until a callback reads it.

No TensorFlow function runs here. Written against Keras 3.15's PyTorch
trainer; besides Keras's public API it reads the torch tensor behind a
variable (`variable.value`) and a tensor's version counter.
"""

import types
import weakref

import keras
import numpy as np
import torch
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

__all__ = [
    "GradientKeeper",
    "Trainer",
    "apply_if",
    "call_if",
    "current_step_gradients",
    "current_step_updates",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "nest_by_path",
    "replay_gradients",
    "numpy_dtype",
    "shared_squares",
    "tf_ops",
    "unscale",
]


def numpy_dtype(dtype):
    """The NumPy dtype of a torch dtype (`ml_dtypes.bfloat16` for bfloat16).

    What `gradient_dtypes` reports: it compares equal to the dtype's name,
    as on the other backends.
    """
    name = keras.backend.standardize_dtype(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _written_message(optimizer, paths):
    return (
        f"The update of optimizer {optimizer.name!r} wrote the gradients of "
        f"{paths} in place, which its earlier steps did not: this step's "
        "kept gradients would not be what it received, so none are kept. "
        "The next steps copy its gradients before the update and keep them "
        "exactly. An optimizer's `update_step` should not write its "
        "`gradient` argument."
    )


class GradientKeeper(base.HostCountedKeeper):
    """Holds one model's kept gradients on PyTorch, keyed by variable path.

    The slots are detached tensors of what the optimizers received
    (copies where that was a parameter's own `.grad`), held by this
    object, not `keras.Variable`s: they are never in `model.weights` or
    saved files.

    Args:
        every: Positive int. Write the slots on steps 1, 1 + every, ...
        name: The model's name, for errors.

    Attributes:
        paths: Paths of the variables the training function keeps, in
            `model.trainable_variables` order; `()` when its step passed
            no gradient to any optimizer; None before its first step.
        trainable_paths: The model's trainable variable paths at its last
            step.
        slots: `{path: tensor}` of the last kept step, or None.
        record_updates: Bool. Also record each update's values before and
            after (`current_step_updates`), for `UpdateRatio`.
    """

    def __init__(self, every=1, name=None):
        super().__init__(every)
        self.name = name
        self.record_updates = False
        # `{optimizer: whether its last apply left its gradients unwritten}`.
        self._reads_only = weakref.WeakKeyDictionary()

    # One training step ---------------------------------------------------

    def begin_step(self, step):
        write = self.writes_next()
        step.backend_state = types.SimpleNamespace(updates={}, write=write)

    def end_step(self, step):
        kept = _capture.finish_step(self, step, update="optimizer.apply")
        if step.backend_state.write:
            self.slots = {p: step.grads[p] for p in kept}
            self._written = self._steps
            if kept and _stats.requested(step.model):
                # In the order the step kept them, as the metrics asked.
                squares = shared_squares(step.grads)
                _stats.store(step.model, kept, squares, source_paths=step.grads)
        self._steps += 1

    def _own(self, step, kept, given):
        """`kept`, detached; on a step that writes the slots, a gradient
        that is one of the tensors `given` is copied (a step without an
        optimizer: `keep_given`)."""
        write = step.backend_state.write
        return [
            densify(k).detach().clone() if write and k is g else densify(k).detach()
            for k, g in zip(kept, given)
        ]

    def _add(self, step, variables, kept):
        step.add(variables, kept, True)

    def keep_from_optimizer(self, step, optimizer, variables, grads, apply):
        """As `base.Keeper.keep_from_optimizer`."""
        with torch.no_grad():
            unscaled = unscale(optimizer, variables, grads)
            kept = [densify(k).detach() for k in unscaled]
            # The gradients `apply` receives as they are, to be copied.
            shared = []
            if step.backend_state.write:
                shared = [i for i, (k, g) in enumerate(zip(unscaled, grads)) if k is g]
            reads_only = self._reads_only.get(optimizer, False)
            if not reads_only:
                for i in shared:
                    kept[i] = kept[i].clone()
            versions = [_compat.tensor_version(grads[i]) for i in shared]
            before = [v.value.detach().clone() for v in variables] if self.record_updates else None
        result = apply(grads, unscaled)
        written = [
            i for i, seen in zip(shared, versions) if _compat.tensor_version(grads[i]) != seen
        ]
        if not reads_only:
            # Copied before the update; after it from the next step on, if
            # this one left every gradient unwritten (cheaper: see the
            # module's docstring).
            if shared:
                self._reads_only[optimizer] = not written
        elif written:
            self._reads_only[optimizer] = False
            raise RuntimeError(_written_message(optimizer, [variables[i].path for i in written]))
        else:
            with torch.no_grad():
                for i in shared:
                    kept[i] = kept[i].clone()
        self._add(step, variables, kept)
        updates = step.backend_state.updates
        for i, variable in enumerate(variables):
            if before is None:
                updates.pop(variable.path, None)
            else:
                updates[variable.path] = (before[i], variable.value.detach())
        return result

    def keep_given(self, step, variables, grads):
        """Keeps `grads` as given (a step without optimizer); returns them."""
        kept = [
            ops.zeros(v.shape, dtype=v.dtype) if g is None else g for v, g in zip(variables, grads)
        ]
        self._add(step, variables, self._own(step, kept, grads))
        for variable in variables:
            step.backend_state.updates.pop(variable.path, None)
        return list(grads)

    # Between steps -------------------------------------------------------

    def _slot_dict(self):
        if self.slots is None:
            raise RuntimeError("No training step wrote the kept gradients yet.")
        return self.slots

    def slot_dtypes(self):
        """`{path: NumPy dtype}` of the kept gradients."""
        slots = self._slot_dict()
        return {path: numpy_dtype(slots[path].dtype) for path in self.paths}

    def read(self):
        """`{path: tensor}` of the last kept step, in variable order.

        The tensors are the ones held (no copy): the keeper never writes
        them, a later step keeps new ones.
        """
        slots = self._slot_dict()
        return {path: slots[path] for path in self.paths}

    def restore(self, variables, arrays, strategy=None):
        """Makes the slots from saved dense gradients (`{path: array}`)."""
        del strategy
        self.paths = self.trainable_paths = tuple(v.path for v in variables)
        self.slots = {v.path: ops.convert_to_tensor(np.asarray(arrays[v.path])) for v in variables}

    def slot_variables(self):
        """Every tensor the keeper holds (for tests and saving)."""
        return list((self.slots or {}).values())


def apply_if(run, apply, optimizer, variables, grads):
    """Runs `apply()` (the optimizer's `apply` of `grads`) where `run` is true.

    The step's bookkeeping runs eagerly, also under `torch.compile`
    (`_torch_compile`), so a Python `if` decides; reading `run` waits for
    the gradients, as a `LossScaleOptimizer`'s own check does.
    """
    del optimizer, variables, grads
    if bool(run):
        return apply()
    return None


def call_if(flag, fn, tensors, rows=()):
    """Runs `fn({name: np.ndarray})` where `flag` is true (`_evidence`):
    the step's bookkeeping runs eagerly, so a Python `if` decides.
    `rows` matter only under a `tf.distribute` strategy."""
    del rows
    if bool(flag):
        fn({name: ops.convert_to_numpy(value) for name, value in tensors.items()})


def replay_gradients(model, x, y, sample_weight, scale):
    """The gradients of `model`'s compiled loss on one batch, as its
    training step computes them (see `_evidence.replay_batch`)."""
    variables = model.trainable_variables
    with torch.enable_grad():
        y_pred = model(x, training=True)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        grads = torch.autograd.grad(loss * scale, [v.value for v in variables], allow_unused=True)
    return [None if g is None else g / scale for g in grads]


class Trainer(base.Trainer):
    """`KeepGradModel` on PyTorch: eager steps; under `torch.compile` the
    keeping runs eagerly between the compiled pieces (`_torch_compile`)."""

    def _new_keeper(self):
        return GradientKeeper(every=self._keep_every, name=self.name)

    def _module_attribute(self, name):
        # `torch.nn.Module` keeps submodules, parameters and buffers out of
        # `__dict__`.
        return torch.nn.Module.__getattr__(self, name)

    def __getattr__(self, name):
        # Only reached when normal lookup fails. `torch.nn.Module`'s
        # `__getattr__` would replace the AttributeError that a property
        # of `KeepGradModel` raised (`gradients` of a model that keeps
        # none) with "no attribute": raise the property's own again.
        for cls in type(self).__mro__:
            if name in vars(cls):
                if isinstance(vars(cls)[name], property) and cls.__module__.startswith(
                    "keras_keepgrad."
                ):
                    return object.__getattribute__(self, name)
                break
        return super().__getattr__(name)

    def _skip_state_out(self, result, pairs, logs):
        # In place (`_compat.torch_assign`), 2 to 6 writes each step. The
        # counts come as Python floats (`_spikes.HOST`): logged as float32
        # tensors, as on the other backends.
        for variable, value in pairs:
            _compat.torch_assign(variable, value)
        logs = {key: torch.as_tensor(value, dtype=torch.float32) for key, value in logs.items()}
        return super()._skip_state_out(result, [], logs)
