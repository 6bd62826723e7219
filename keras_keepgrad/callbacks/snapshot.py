"""`GradientSnapshot`: the kept gradients as `.npz` files, written atomically.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.
"""

import glob
import os
import re
import string
import warnings

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad import _files
from keras_keepgrad.callbacks import _reading

__all__ = ["GradientSnapshot"]

_RESERVED_KEYS = ("step", "epoch", "loss_scale")

_TEMPORARY = _files.TEMPORARY
_TAG_LENGTH = _files.TAG_LENGTH
_atomic_savez = _files.atomic_savez


class GradientSnapshot(keras.callbacks.Callback):
    """Writes the kept gradients to `.npz` files for offline analysis.

    Each file holds one array per trainable variable, keyed by its path
    (`"dense_0/kernel"`), as `model.get_gradients_by_path()` returns it
    (bfloat16 is stored as float32, which NumPy can read), and three
    scalars: `step` (training batches run in this `fit`), `epoch` (the
    1-based epoch in which `step` ran, as in the file name) and
    `loss_scale` (a `LossScaleOptimizer`'s dynamic scale as the file is
    written: after the step, or under `keep_every` possibly some steps
    later; else the optimizer's `loss_scale_factor`, else 1.0; the
    gradients are already unscaled).

    A file is never half-written: it is written to a temporary file in the
    same directory, then renamed over the target; the temporaries that a
    process killed mid-write left behind (`.<file name>.<12 hex
    digits>.tmp`, for the files `path` names) are removed at the start of
    the next `fit`. Without `{step}` or
    `{epoch}` in `path`, each snapshot replaces the previous one. A write
    that fails during `fit` is warned about and training goes on.

    Args:
        path: Str or path ending in `.npz`. May hold the fields `{step}`
            and `{epoch}`, with format specs: `"grads/{step:06d}.npz"`.
        every: `"epoch"` (the epoch's last batch) or a positive int (every
            this many training batches). Defaults to `"epoch"`.

    Attributes:
        files: List of the file names written, in order (a name repeats
            when each snapshot replaces the last).

    Raises:
        ValueError: On an invalid `path` or `every`; when the directory of
            `path` is not writable, or the model was built with
            `keep_gradients=False` (both at the start of `fit`).
        TypeError: The model is not a `KeepGradModel` (at the start of `fit`).

    Examples:
        ```python
        snapshot = kg.callbacks.GradientSnapshot("grads/{step:05d}.npz", every=100)
        model.fit(x, y, epochs=3, callbacks=[snapshot])
        data = np.load(snapshot.files[-1])
        data["dense_0/kernel"], int(data["step"]), float(data["loss_scale"])
        ```
    """

    def __init__(self, path: str | os.PathLike, every: str | int = "epoch") -> None:
        super().__init__()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                "`path` must be a str or os.PathLike naming an '.npz' file "
                "(e.g. 'grads/{step:06d}.npz'). Received: "
                f"path={path!r} of type {type(path).__name__}"
            )
        self.path = os.fspath(path)
        self.every = _checks.check_frequency("every", every, allow_batch=False)
        if not self.path.endswith(".npz"):
            raise ValueError(
                "`path` must end in '.npz' (e.g. 'grads/{step:06d}.npz'). "
                f"Received: path={self.path!r}"
            )
        try:
            self.path.format(step=0, epoch=1)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError) as error:
            # TypeError, AttributeError: `{step[0]}`, `{step.x}` index an int.
            raise ValueError(
                "`path` may only hold the fields {step} and {epoch} (with "
                f"format specs like {{step:06d}}). Received: path={self.path!r} "
                f"({type(error).__name__}: {error})"
            ) from error
        self.files = []
        self._steps = _reading.StepCounter()
        self._new = _reading.NewGradients(self)

    def on_train_begin(self, logs=None):
        _checks.require_kept_gradients(self.model, "GradientSnapshot")
        if self.model.built:
            # Fail before the first step where the variables exist already.
            self._check_paths(_reading.trainable_paths(self.model))
        directory = os.path.dirname(os.path.abspath(self.path.format(step=0, epoch=1)))
        _checks.check_writable_dir(directory, "path", self.path)
        _remove_stale_temporaries(self.path)
        self._steps.begin_train()
        self._new.begin(self.model)

    def _check_paths(self, paths):
        clashes = sorted(set(paths) & set(_RESERVED_KEYS))
        if clashes:
            raise ValueError(
                f"GradientSnapshot stores {list(_RESERVED_KEYS)} beside the "
                f"variable paths, but the model has variables named {clashes}. "
                "Rename them."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._steps.begin_epoch(epoch)
        self._epoch_first_step = self._steps.step

    def on_train_batch_end(self, batch, logs=None):
        previous = self._steps.end_batch(
            batch, self.params, getattr(self.model, "steps_per_execution", 1)
        )
        if self.every != "epoch" and _reading.crossed(previous, self._steps.step, self.every):
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        if self.every == "epoch" and self._steps.step > self._epoch_first_step:
            self._write()

    def _write(self):
        # Read at each write, not at `on_train_begin`: a model built by its
        # first batch has no variables before it, and a step may keep other
        # variables than the last.
        model = _reading.unsynced_model(self)
        kept = model.kept_step
        paths = _reading.kept_paths(model, kept)
        if not paths:
            return
        self._check_paths(paths)
        step = self._new.step_of(model, self._steps.step, kept)
        if step is None:
            return  # `keep_every`: nothing kept since the last file
        epoch = self._steps.epoch_of(step) + 1
        filename = self.path.format(step=step, epoch=epoch)
        arrays = {}
        for path, grad in _reading.readable_gradients(model).items():
            arrays[path] = keras.ops.convert_to_numpy(grad)
        arrays["step"] = np.int64(step)
        arrays["epoch"] = np.int64(epoch)
        arrays["loss_scale"] = np.float64(_reading.loss_scale_of(self.model.optimizer))
        try:
            _atomic_savez(filename, arrays)
        except OSError as error:
            warnings.warn(
                f"GradientSnapshot could not write {filename!r}: {error}. Training continues.",
                stacklevel=2,
            )
            return
        self.files.append(filename)


def _field_pattern(spec):
    """A regex for what an int formatted with `spec` can look like."""
    if spec[-1:] in ("", "d", "n") or spec[-1:].isdigit():
        # Padded with spaces or zeros, signed, with thousands separators.
        return r"[ +\-]?[ 0-9,_]*[0-9]"
    return r".+?"  # another base or fill: any non-empty text


def _remove_stale_temporaries(path):
    """Removes what `_atomic_savez` left behind writing `path`'s files.

    A process killed while writing leaves its temporary: a hidden file
    named `_TEMPORARY` after a file name that `path` formats to. Only those
    are removed, in the directories `path`'s files go to; what cannot be
    removed stays.
    """
    directory, basename = os.path.split(os.path.abspath(path))
    if "://" in directory:
        return
    parts = []
    for literal, field, spec, _ in string.Formatter().parse(basename):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(_field_pattern(spec or ""))
    pattern = re.compile(re.escape(".") + "".join(parts) + rf"\.[0-9a-f]{{{_TAG_LENGTH}}}\.tmp")
    # A directory holding `{epoch}` or `{step}`: each one that exists.
    directories = glob.glob(
        "".join(
            glob.escape(literal) + ("" if field is None else "*")
            for literal, field, _, _ in string.Formatter().parse(directory)
        )
    )
    for found in directories:
        try:
            names = os.listdir(found)
        except OSError:
            continue
        for name in names:
            if pattern.fullmatch(name):
                try:
                    os.remove(os.path.join(found, name))
                except OSError:
                    pass
