"""What the gradient callbacks share to read the kept values between steps.

Callbacks read the kept gradients between steps through the model's
public API only: `model.kept_step` says which step the slots hold and what
it kept, `model.get_gradients_by_path()` gives them as a flat
`{variable path: dense tensor}` view; everything here returns NumPy
values or ints.
"""

import bisect
import warnings

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _stats
from keras_keepgrad._squares import GradientNorms
from keras_keepgrad.callbacks import _skipped

__all__ = [
    "KeptStepReader",
    "LatestNorms",
    "unsynced_model",
    "NewGradients",
    "StepCounter",
    "crossed",
    "kept_paths",
    "loss_scale_of",
    "readable_gradients",
    "trainable_paths",
]


class LatestNorms:
    """A callback's view of each new step's norms.

    Reads the statistics the training step recorded (`_stats.read`: one
    small vector) when they describe a step this reader has not seen, else
    the kept gradients themselves (a step that does not record, e.g. under
    a `tf.distribute` strategy whose slots hold per-replica parts).

    Args:
        model: The `KeepGradModel`, at `on_train_begin`.
    """

    def __init__(self, model):
        self.norms = GradientNorms(kept_paths(model))
        self._seen = _stats.count(model)
        self._followed = None  # the `kept_step.paths` last followed

    def follow(self, model, kept=None):
        """Takes the paths the step kept; returns whether they changed.

        Before the training function is traced (at the first `fit`'s
        `on_train_begin`) they are not known, and taken to be the trainable
        paths; a step may keep fewer (a variable no optimizer receives).
        Called every batch: the kept `paths`, set anew by each traced step,
        are compared by identity before the paths are listed.

        Args:
            model: The model.
            kept: Its `kept_step`, if the caller read it already.
        """
        if kept is None:
            kept = model.kept_step
        followed = None if kept is None else kept.paths
        if followed and followed is self._followed:
            return False
        self._followed = followed
        paths = tuple(kept_paths(model, kept))
        if paths == self.norms.paths:
            return False
        self.norms = GradientNorms(paths)
        return True

    @property
    def paths(self):
        return self.norms.paths

    @property
    def layers(self):
        return self.norms.layers

    def read(self, model, logs=None):
        """The `StepNorms` of the step the slots hold.

        Args:
            model: The model.
            logs: The `on_train_batch_end` logs, so that the callbacks of
                one batch share one read (`_stats.read`).
        """
        found = _stats.read(model, logs)
        if found is not None:
            count, paths, squares = found
            if count > self._seen and paths == self.norms.paths:
                self._seen = count
                if np.isfinite(squares).all():
                    return self.norms.from_squares(squares)
                # Overflow or NaN/inf: the slots tell them apart (float64).
        return self.norms(readable_gradients(model))


class StepCounter:
    """Counts the training batches run since `on_train_begin`.

    Keras calls `on_train_batch_end(batch)` once per execution with the
    index of its last batch in the epoch; with `steps_per_execution=N` the
    count thus advances by N. The last, possibly partial, execution of an
    epoch is clamped to the epoch's number of batches when Keras knows it.

    It also remembers where each epoch of this `fit` began, so that a step
    read later (under `keep_every`, the kept gradients can come from an
    earlier epoch) is labelled with the epoch it ran in: `epoch_of`.
    """

    def __init__(self):
        self.begin_train()

    def begin_train(self):
        self.step = 0
        # Steps run before each epoch began, and its (0-based) epoch number
        # as Keras passes it (so `initial_epoch` counts).
        self._starts = []
        self._epochs = []

    def begin_epoch(self, epoch):
        """At `on_epoch_begin(epoch)`: the epoch's steps start after now."""
        self._starts.append(self.step)
        self._epochs.append(epoch)

    def epoch_of(self, step):
        """The 0-based epoch in which training step `step` (1-based) ran.

        Steps before the first epoch began (none in `fit`) count as the
        first epoch.
        """
        if not self._epochs:
            return 0
        index = bisect.bisect_left(self._starts, step) - 1
        return self._epochs[max(index, 0)]

    def end_batch(self, batch, params, steps_per_execution=1):
        """Advances to `batch` (0-based, in the epoch); returns the old step."""
        in_epoch = _compat.last_batch_of_execution(batch, steps_per_execution) + 1
        steps = (params or {}).get("steps")
        if steps:
            in_epoch = min(in_epoch, steps)
        epoch_start = self._starts[-1] if self._starts else 0
        previous, self.step = self.step, epoch_start + in_epoch
        return previous


class NewGradients:
    """Tells a callback whether the slots hold gradients it has not read.

    With `keep_every=N` the slots are written on every N-th step only; in
    between they hold an earlier step's gradients. A callback reads them
    only when they are new, and labels them with the step they come from.
    """

    def __init__(self, owner):
        self._owner = owner
        self._seen = None
        self._warned = False

    def begin(self, model):
        """At `on_train_begin`: what the slots hold now counts as read.

        The slots may still hold a write of an earlier `fit`; a step of
        this `fit` cannot be its label.
        """
        kept = model.kept_step
        self._seen = None if kept is None else kept.write

    def nothing_kept(self, model, kept=None):
        """Whether the last step kept nothing; warns the first time it did.

        Args:
            model: The model.
            kept: Its `kept_step`, if the caller read it already.
        """
        if kept is None:
            kept = model.kept_step
        # A step of a model without trainable variables keeps nothing either,
        # and has nothing to say.
        if kept is None or kept.paths != () or not model.trainable_variables:
            return False
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{type(self._owner).__name__}: nothing to read. "
                + _checks.nothing_kept_message(model),
                stacklevel=3,
            )
        return True

    def step_of(self, model, step, kept=None):
        """The step the kept gradients come from, or None if already read.

        Args:
            model: The `KeepGradModel` being trained.
            step: The callback's current step (`StepCounter.step`).
            kept: Its `kept_step`, if the caller read it already.
        """
        if kept is None:
            kept = model.kept_step
        if self.nothing_kept(model, kept):
            return None
        write, age = (None, 0) if kept is None else (kept.write, kept.age)
        if write is not None:
            if write == self._seen:
                return None
            self._seen = write
        return step - age


class KeptStepReader(keras.callbacks.Callback):
    """A callback that reads the kept norms once per new kept step.

    What `GradientMonitor`, `GradientReport` and `GradientTensorBoard`
    share: it asks for the step's statistics when Keras hands it the model
    (before `fit` makes the training function), counts the training steps
    (`StepCounter`), follows the layers the step keeps (`LatestNorms`,
    calling `_on_layers_changed()` when they change) and which steps
    `skip_bad_steps` skipped (`SkippedLog`: `self._skips`), and reads the
    norms of each kept step it has not read yet (`NewGradients`), passing
    them to `_on_kept_step(step, epoch, norms)`: the step the gradients
    come from (under `keep_every` it may be earlier than now) and the
    0-based epoch it ran in.

    By default it reads after every training batch for which
    `_read_due(previous)` is true (`previous`: the step count before the
    batch); a subclass with other times (`GradientTensorBoard`) calls
    `_advance` and `_read_kept` itself.
    """

    # The name that errors and warnings give the callback.
    _callback_name = "KeptStepReader"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps = StepCounter()
        self._new = NewGradients(self)
        self._skips = _skipped.SkippedLog()
        self._norms = None
        self._logs = None  # this batch's, for `_stats.read`

    def set_model(self, model):
        super().set_model(model)
        # Before `fit` makes the training function: it records the norms.
        _stats.require(model)

    def on_train_begin(self, logs=None):
        _checks.require_kept_gradients(self.model, self._callback_name)
        super().on_train_begin(logs)
        self._steps.begin_train()
        self._new.begin(self.model)
        self._skips = _skipped.SkippedLog()
        self._norms = LatestNorms(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._steps.begin_epoch(epoch)
        self._skips.begin_epoch()

    def on_train_batch_end(self, batch, logs=None):
        previous = self._advance(batch, logs)
        model = unsynced_model(self)
        kept = model.kept_step
        self._follow(model, kept)
        if self._read_due(previous):
            self._read_kept(model, kept)

    def _advance(self, batch, logs):
        """Counts the batch's steps and its skipped ones; returns the old step."""
        self._logs = logs if isinstance(logs, dict) else None
        model = unsynced_model(self)
        previous = self._steps.end_batch(
            batch, self.params, getattr(model, "steps_per_execution", 1)
        )
        self._skips.end_batch(self._logs, previous, self._steps.step)
        return previous

    def _read_due(self, previous):
        """Whether to read after the batch that began after step `previous`."""
        return True

    def _follow(self, model=None, kept=None):
        """Takes the layers the step kept; `_on_layers_changed()` if new."""
        if model is None:
            model = unsynced_model(self)
        if self._norms.follow(model, kept):
            self._on_layers_changed()

    def _on_layers_changed(self):
        """The step keeps other layers than `self._norms` read until now."""

    def _read_kept(self, model, kept):
        """Reads the kept step, if this callback has not: `_on_kept_step`."""
        if not self._norms.paths:
            return
        step = self._new.step_of(model, self._steps.step, kept)
        if step is None:
            return  # `keep_every`: nothing kept since the last read
        norms = self._norms.read(model, self._logs)
        self._on_kept_step(step, self._steps.epoch_of(step), norms)
        self._skips.forget(step)

    def _on_kept_step(self, step, epoch, norms):
        """Called once per kept step read, with its `StepNorms`."""
        raise NotImplementedError

    def _was_skipped(self, step, norms):
        """Whether `skip_bad_steps` skipped the update of kept step `step`.

        As `fit`'s logged `skipped_steps` say (`SkippedLog`). Where they
        cannot tell (an execution of several steps that skipped some but not
        all of them), a step with non-finite gradients (`norms`) was skipped
        if the model's `skip_bad_steps` judges them, a finite one was not.
        Call it from `_on_kept_step`.
        """
        skipped = self._skips.skipped(step)
        if skipped is None:
            config = getattr(unsynced_model(self), "skip_bad_steps", None)
            skipped = norms.nonfinite and config is not None and config.nonfinite
        return skipped


def crossed(previous, step, freq):
    """Whether the step count passed a multiple of `freq` since `previous`."""
    return step // freq > previous // freq


def loss_scale_of(optimizer):
    """The optimizer's loss scale, as a float.

    The dynamic scale of a `LossScaleOptimizer`, read now (after the step,
    which may have halved or doubled it), else the optimizer's static
    `loss_scale_factor`, else 1.0.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            return float(optimizer.dynamic_scale.numpy())
        return float(optimizer.initial_scale)
    factor = getattr(optimizer, "loss_scale_factor", None)
    return 1.0 if factor is None else float(factor)


def readable_gradients(model):
    """`model.get_gradients_by_path()`, bfloat16 gradients cast to float32.

    The callbacks read the kept gradients through TensorFlow and NumPy:
    PyTorch's bfloat16 tensors convert to neither (NumPy has no bfloat16),
    and a bfloat16 file or histogram is of little use. The cast is exact.
    """
    grads = model.get_gradients_by_path()
    return {
        path: keras.ops.cast(grad, "float32")
        if keras.backend.standardize_dtype(grad.dtype) == "bfloat16"
        else grad
        for path, grad in grads.items()
    }


def unsynced_model(callback):
    """`callback.model`, without synchronizing the model's state.

    On JAX, Keras's `Callback.model` copies the training state into the
    model's variables (`jax_state_sync`) every time it is read. Kept
    gradients and the step's statistics live in the keeper, not in those
    variables: per-batch hooks read them through this, and `callback.model`
    only where they read a variable (the optimizer's loss scale).
    Keras's own callbacks do the same. A model wrapped for PyTorch's
    `DistributedDataParallel` is unwrapped by `callback.model`.
    """
    model = _compat.callback_model(callback)
    return model if hasattr(model, "kept_step") else callback.model


def trainable_paths(model):
    return [v.path for v in model.trainable_variables]


def kept_paths(model, kept=None):
    """The paths the model's last traced step kept, else its trainable paths.

    Args:
        model: The model.
        kept: Its `kept_step`, if the caller read it already.
    """
    if kept is None:
        kept = model.kept_step
    if kept is not None and kept.paths:
        return list(kept.paths)
    return trainable_paths(model)
