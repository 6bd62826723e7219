"""The keeping mechanism on PyTorch: the gradient tensors themselves, held.

On Keras's PyTorch backend a training step runs eagerly, in Python:
Keras's `train_step` calls `self.zero_grad()` (which sets every
parameter's `.grad` to None), the scaled loss's `backward()`, reads each
variable's `v.value.grad` and calls `optimizer.apply(grads, variables)`
under `torch.no_grad()`. (With `jit_compile=True` Keras would hand the
step to `torch.compile`; a keeping model refuses that, see
`KeepGradModel._refuse_torch_compile`.)

Keeping follows that model. `_capture` hands this keeper the gradients
each `optimizer.apply` receives (a `LossScaleOptimizer`'s inner `apply` is
not counted twice); `_capture.unscale` turns them into what the update
receives. The keeper holds those tensors, detached, outside Keras's
variables: never in `model.weights`, saved files or exports.

It holds references rather than copies. Without loss scaling a kept
gradient is the parameter's `.grad` tensor itself, and holding it copies
nothing: Keras's optimizers read gradients without writing them (their
in-place `torch._foreach_*_` ops write the variables and their own state),
clipping returns new tensors, and the next step's `zero_grad()` drops the
reference from `.grad` instead of zeroing the buffer, so `backward()`
writes the next gradients into a fresh one. A step of the user's own can
still write a held tensor in place (`p.grad.zero_()`,
`zero_grad(set_to_none=False)`, a `backward()` that accumulates into an
existing `.grad`); such a write bumps the tensor's version counter, which
the keeper checks: a kept gradient written after its optimizer received it
raises an error rather than showing another value. Between writes
(`keep_every > 1`) the held tensors are copied once, at the first step
that does not write them, as the steps in between may write them legally.

Nothing here imports TensorFlow. Written against Keras 3.15's PyTorch
trainer; besides Keras's public API it reads the torch tensor behind a
variable (`variable.value`) and PyTorch's version counter of a tensor
(`tensor._version`, which every in-place write increments).
"""

import itertools
import types

import keras
import numpy as np
import torch
from keras import ops

from keras_keepgrad import _capture
from keras_keepgrad._capture import evaluation_step
from keras_keepgrad._capture import in_evaluation_step
from keras_keepgrad._capture import nest_by_path
from keras_keepgrad._ops import shared_squares
from keras_keepgrad._ops import tf_ops

__all__ = [
    "GradientKeeper",
    "current_step_gradients",
    "current_step_updates",
    "densify",
    "evaluation_step",
    "in_evaluation_step",
    "nest_by_path",
    "numpy_dtype",
    "shared_squares",
    "tf_ops",
    "unscale",
]


def unscale(optimizer, variables, grads):
    """What the optimizer's update receives (`_capture.unscale`)."""
    return _capture.unscale(optimizer, variables, grads)


def densify(grad):
    """The gradient as a tensor (PyTorch gradients here are dense)."""
    return ops.convert_to_tensor(grad)


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


def current_step_gradients():
    """The `{path: grad}` kept so far in the training step being run, else None."""
    step = _capture.current_step()
    return None if step is None else step.grads


def current_step_updates():
    """`{path: (value before, value after)}` of the step's optimizer updates.

    Recorded only where the keeper was asked to (`record_updates`, for
    `UpdateRatio`): the value before is a copy.
    """
    step = _capture.current_step()
    return None if step is None else step.backend_state.updates


def _modified_message(name, paths):
    return (
        f"The kept gradients of {paths} of model {name!r} were "
        "modified in place after the optimizer received them, so they no "
        "longer hold what it received. Something wrote the tensors passed "
        "to `optimizer.apply` (e.g. `p.grad.zero_()`, "
        "`zero_grad(set_to_none=False)`, or a `backward()` accumulating "
        "into an existing `.grad`). In your own `train_step`, clear the "
        "gradients with `self.zero_grad()` (which sets `.grad` to None) "
        "before `loss.backward()`, and do not write them after "
        "`optimizer.apply(...)`."
    )


_KEEPER_SERIALS = itertools.count()


class GradientKeeper:
    """Holds one model's kept gradients on PyTorch, keyed by variable path.

    The slots are the (detached) tensors the optimizers received, held by
    this object, not `keras.Variable`s: they are never in `model.weights`
    or saved files. Each slot's version counter, noted when it is kept,
    tells whether it was written in place since (see the module's
    docstring).

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
        self.every = every
        self.name = name
        self.paths = None
        self.trainable_paths = None
        self.slots = None
        self.record_updates = False
        self._versions = {}
        self._owned = False
        self._serial = next(_KEEPER_SERIALS)
        self._steps = 0
        self._written = -1
        self._warned_missing = False

    @property
    def built(self):
        return self.paths is not None

    @property
    def kept_nothing(self):
        """Whether the last step had trainable variables but kept nothing."""
        return self.paths == () and bool(self.trainable_paths)

    def has_sparse_slots(self):
        """The kept gradients are dense: never."""
        return False

    # One training step ---------------------------------------------------

    def begin_step(self, step):
        write = self.writes_next()
        step.backend_state = types.SimpleNamespace(updates={}, versions={}, write=write)
        if not write and self.slots is not None and not self._owned:
            # Held over this step, which may write its parameters' `.grad`
            # (the tensors held) in place: a copy of their own, once.
            self._check_unmodified()
            self.slots = {p: t.clone() for p, t in self.slots.items()}
            self._versions = {p: t._version for p, t in self.slots.items()}
            self._owned = True

    def end_step(self, step):
        kept = _capture.finish_step(self, step, update="optimizer.apply")
        state = step.backend_state
        modified = [p for p in kept if step.grads[p]._version != state.versions[p]]
        if modified:
            raise RuntimeError(_modified_message(step.model.name, modified))
        if state.write:
            self.slots = {p: step.grads[p] for p in kept}
            self._versions = {p: state.versions[p] for p in kept}
            self._owned = False
            self._written = self._steps
        self._steps += 1

    def _add(self, step, variables, kept):
        kept = [densify(g).detach() for g in kept]
        step.add(variables, kept, True)
        for variable, grad in zip(variables, kept):
            step.backend_state.versions[variable.path] = grad._version

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
        with torch.no_grad():
            kept = unscale(optimizer, variables, grads)
            before = [v.value.detach().clone() for v in variables] if self.record_updates else None
        result = apply(grads)
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
        self._add(step, variables, kept)
        for variable in variables:
            step.backend_state.updates.pop(variable.path, None)
        return list(grads)

    # Between steps -------------------------------------------------------

    def writes_next(self):
        """Whether the next step writes the slots (steps 1, 1 + every, ...)."""
        return self._steps % self.every == 0

    def last_write(self):
        """`(write, age)`, as `_keeper.GradientKeeper.last_write`."""
        if self.every == 1 or self._written < 0:
            return None, 0
        return (self._serial, self._written), self._steps - 1 - self._written

    def _slot_dict(self):
        if self.slots is None:
            raise RuntimeError("No training step wrote the kept gradients yet.")
        return self.slots

    def _check_unmodified(self):
        modified = [p for p, t in self._slot_dict().items() if t._version != self._versions[p]]
        if modified:
            raise RuntimeError(_modified_message(self.name, modified))

    def slot_dtypes(self):
        """`{path: NumPy dtype}` of the kept gradients."""
        slots = self._slot_dict()
        return {path: numpy_dtype(slots[path].dtype) for path in self.paths}

    def read(self):
        """`{path: tensor}` of the last kept step, in variable order.

        The tensors are the ones held (no copy).

        Raises:
            RuntimeError: One was written in place since it was kept.
        """
        self._check_unmodified()
        slots = self._slot_dict()
        return {path: slots[path] for path in self.paths}

    def restore(self, variables, arrays, strategy=None):
        """Makes the slots from saved dense gradients (`{path: array}`)."""
        del strategy
        self.paths = self.trainable_paths = tuple(v.path for v in variables)
        self.slots = {v.path: ops.convert_to_tensor(np.asarray(arrays[v.path])) for v in variables}
        self._versions = {p: t._version for p, t in self.slots.items()}
        self._owned = True

    def slot_variables(self):
        """Every tensor the keeper holds (for tests and saving)."""
        return list((self.slots or {}).values())
