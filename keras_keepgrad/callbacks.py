"""Callbacks that read the kept gradients: TensorBoard panels, alarms, files.

All three read `model.get_gradients_by_path()` between training steps (never
inside `train_step`: a `tf.summary` call traced into the step function would
freeze its step and `record_if` at trace time), so they need a model that
keeps gradients (`KeepGradModel` or `keep_gradients(model)`).

Steps. A callback's step is the number of training batches run since `fit`
began. With `steps_per_execution=N` Keras calls back once per execution: the
callbacks see the gradients of the last of the N batches, and the step
advances by N. "Every k batches" means whenever the step passes a multiple
of k. Validation batches never change the kept gradients.

Layers. Per-layer values group variables by their path minus the last
component (`"dense_0/kernel"` and `"dense_0/bias"` make layer `"dense_0"`;
`"encoder/dense/kernel"` makes `"encoder/dense"`), in the order of
`model.trainable_variables`, which is forward order for Sequential and
functional models.
"""

import numbers
import os
import uuid
import warnings
from collections import deque

import keras
import numpy as np
import tensorflow as tf

from keras_keepgrad import _grad_stats
from keras_keepgrad import _tb_panels

__all__ = ["GradientMonitor", "GradientSnapshot", "GradientTensorBoard"]


def _check_non_negative_int(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(
        f"`{name}` must be a non-negative int (0 disables it). Received: {name}={value!r}"
    )


def _check_positive_int(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")


def _check_positive_float(name, value, above=0.0, or_none=True):
    if value is None and or_none:
        return None
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and np.isfinite(value)
        and value > above
    ):
        return float(value)
    none = " or None (off)" if or_none else ""
    raise ValueError(
        f"`{name}` must be a finite number above {above:g}{none}. Received: {name}={value!r}"
    )


def _check_bool(name, value):
    if isinstance(value, bool):
        return value
    raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")


def _trainable_paths(model):
    return [v.path for v in model.trainable_variables]


class GradientTensorBoard(keras.callbacks.TensorBoard):
    """A `keras.callbacks.TensorBoard` that also draws the kept gradients.

    Writes everything `keras.callbacks.TensorBoard` writes, and under
    `log_dir/train`:

    - `gradients/layer_norm/<layer>`: the L2 norm of each layer's gradients,
      and `gradients/global_norm`, the norm over all of them; every
      `update_freq` batches (with `"epoch"`: at each epoch end, from the
      epoch's last batch), at the training-batch step.
    - `gradients/nonfinite`: 1.0 where that step's gradients hold a NaN or
      an infinity, else 0.0. Under a `keras.optimizers.LossScaleOptimizer`
      also `gradients/skipped_steps` (the steps it skipped since `fit`
      began) and `gradients/loss_scale`.
    - `gradients/histogram/<variable path>`: histograms of the gradients of
      the epoch's last batch (its finite values), every `histogram_freq`
      epochs, at the epoch step, beside Keras's weight histograms.
    - `gradients/heatmap`: at each epoch end, an image of log10 layer norms,
      layers (rows, forward order) by recorded steps (columns), for the
      whole run so far.
    - A custom-scalars layout, "Gradient panels": per-layer norms in one
      multiline chart, the global norm, non-finite and skipped steps (and
      the loss scale under a `LossScaleOptimizer`).

    Layers are variable paths minus their last component; see the module
    docstring, also for steps under `steps_per_execution`.

    Cost: with `update_freq="epoch"` the gradients are read once per epoch.
    With an integer `update_freq` every recorded step reads all gradients
    and writes one scalar per layer.

    Args:
        log_dir: Str or path. The directory to write to, as for
            `keras.callbacks.TensorBoard`. Defaults to `"logs"`.
        histogram_freq: Int. Write weight (Keras) and gradient histograms
            every this many epochs; 0 writes none. Defaults to `0`.
        update_freq: `"epoch"`, `"batch"` (= 1) or a positive int. When to
            write Keras's batch metrics and the gradient norms. Defaults to
            `"epoch"`.
        write_heatmap: Bool. Write the heatmap image at each epoch end.
            Defaults to `True`.
        **kwargs: Passed on to `keras.callbacks.TensorBoard`
            (`write_graph`, `write_images`, `profile_batch`, ...).

    Raises:
        ValueError: On an invalid `update_freq` or `histogram_freq`; when
            `log_dir` is not writable (raised before training starts).
        TypeError: The model does not keep gradients (at the start of `fit`).

    Example:

    ```python
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=5, callbacks=[
        kg.callbacks.GradientTensorBoard("logs", update_freq=10,
                                         histogram_freq=1)])
    # tensorboard --logdir logs  ->  Custom Scalars: "Gradient panels"
    ```
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq=0,
        update_freq="epoch",
        write_heatmap=True,
        **kwargs,
    ):
        update_freq = _grad_stats.check_frequency("update_freq", update_freq)
        histogram_freq = _check_non_negative_int("histogram_freq", histogram_freq)
        super().__init__(
            log_dir=log_dir,
            histogram_freq=histogram_freq,
            update_freq=update_freq,
            **kwargs,
        )
        self.write_heatmap = _check_bool("write_heatmap", write_heatmap)
        self._steps = _grad_stats.StepCounter()
        self._norms = None
        self._heatmap = None
        self._layout_written = False
        self._warned = False

    def set_model(self, model):
        # Fail at `fit`'s start with a clear message, not from the writer.
        _grad_stats.check_writable_dir(
            os.path.join(self.log_dir, "train"), "log_dir", self.log_dir
        )
        super().set_model(model)

    def on_train_begin(self, logs=None):
        _grad_stats.require_kept_gradients(self.model, "GradientTensorBoard")
        super().on_train_begin(logs)
        self._steps.begin_train()
        self._norms = _grad_stats.GradientNorms(_trainable_paths(self.model))
        self._heatmap = _tb_panels.Heatmap()
        optimizer = self.model.optimizer
        self._loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # The inner optimizer's iterations only advance on applied steps; under
        # gradient accumulation they count updates, not steps.
        self._count_skipped = self._loss_scaled and not getattr(
            optimizer.inner_optimizer, "gradient_accumulation_steps", None
        )
        self._iterations_at_begin = (
            int(optimizer.iterations.numpy())
            if self._count_skipped
            else 0
        )
        tags = [_tb_panels.layer_norm_tag(layer) for layer in self._norms.layers]
        tags += [_tb_panels.GLOBAL_NORM_TAG, _tb_panels.NONFINITE_TAG]
        if self._loss_scaled:
            tags.append(_tb_panels.LOSS_SCALE_TAG)
        if self._count_skipped:
            tags.append(_tb_panels.SKIPPED_STEPS_TAG)
        self._scalars = _tb_panels.ScalarWriter(
            self._train_writer, tags, traced=self.update_freq != "epoch"
        )
        if not self._layout_written:
            self._guarded(self._write_layout)
            self._layout_written = True

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._steps.begin_epoch()
        self._epoch_first_step = self._steps.step

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        previous = self._steps.end_batch(batch, self.params)
        if self.update_freq != "epoch" and _grad_stats.crossed(
            previous, self._steps.step, self.update_freq
        ):
            self._guarded(self._record)

    def on_epoch_end(self, epoch, logs=None):
        # Keras 3.15 leaves its batch-level `record_if` (counting executions)
        # active here, so with an integer `update_freq` it silently drops the
        # epoch metrics and weight histograms of some epochs.
        with tf.summary.record_if(True):
            super().on_epoch_end(epoch, logs)
        if self._steps.step == 0:
            return
        if self.update_freq == "epoch" and self._steps.step > self._epoch_first_step:
            self._guarded(self._record)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._guarded(self._write_histograms, epoch)
        if self.write_heatmap and self._heatmap.columns:
            self._guarded(self._write_heatmap, epoch)
        self._guarded(self._train_writer.flush)

    def _guarded(self, fn, *args):
        # A TensorBoard problem is warned about once, never raised mid-`fit`.
        try:
            fn(*args)
        except (tf.errors.OpError, OSError) as error:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"GradientTensorBoard could not write to {self.log_dir!r}: "
                    f"{error}. Training continues without gradient summaries.",
                    stacklevel=2,
                )

    def _write_layout(self):
        with self._train_writer.as_default(), tf.summary.record_if(True):
            if not _tb_panels.write_layout(self._loss_scaled):
                warnings.warn(
                    "The `tensorboard` package is not installed: "
                    "GradientTensorBoard writes no custom-scalars layout.",
                    stacklevel=3,
                )

    def _record(self):
        step = self._steps.step
        norms = self._norms(self.model.get_gradients_by_path())
        values = list(norms.layer_norms) + [norms.global_norm, float(norms.nonfinite)]
        optimizer = self.model.optimizer
        if self._loss_scaled:
            values.append(_grad_stats.loss_scale_of(optimizer))
        if self._count_skipped:
            applied = int(optimizer.iterations.numpy()) - self._iterations_at_begin
            values.append(step - applied)
        self._scalars.write(step, values)
        self._heatmap.add(step, norms.layer_norms)

    def _write_histograms(self, epoch):
        grads = self.model.get_gradients_by_path()
        with self._train_writer.as_default(), tf.summary.record_if(True):
            for path, grad in grads.items():
                tf.summary.histogram(
                    _tb_panels.histogram_tag(path),
                    _tb_panels.finite_values(grad),
                    step=epoch,
                )

    def _write_heatmap(self, epoch):
        with self._train_writer.as_default(), tf.summary.record_if(True):
            tf.summary.image(
                _tb_panels.HEATMAP_TAG,
                self._heatmap.image(),
                step=epoch,
                description=_tb_panels.HEATMAP_DESCRIPTION,
            )


_ACTIONS = ("warn", "stop", "raise")


class GradientMonitor(keras.callbacks.Callback):
    """Watches the kept gradients for NaN, vanishing and exploding layers.

    Every `check_freq` training batches it looks at the gradients kept for
    the last batch and reports:

    - non-finite gradients (NaN or inf), naming the affected layers in
      forward order (the first one listed is the earliest layer hit);
    - vanishing layers: a layer's gradient norm stayed below
      `vanishing_threshold` for `vanishing_steps` checks in a row;
    - explosions: the global gradient norm is above `exploding_threshold`,
      or above `exploding_factor` times the median of the last
      `median_window` global norms (once at least `min(10, median_window)`
      are known), naming the layers with the largest norms.

    Each problem is reported once when it starts (again only after it went
    away), as configured by `action`, and appended to `monitor.events`.

    Under a `keras.optimizers.LossScaleOptimizer`, a non-finite step is
    normal: the optimizer skips it and halves its loss scale. Such steps only
    count once the scale has dropped below `min_loss_scale` (read after the
    step): from then on the scale no longer amplifies the gradients, so
    lowering it cannot help, and the non-finite values are the model's own.
    With the default 1.0 and Keras's initial scale of 2**15, persistent NaN
    is reported on the 16th skipped step in a row.

    Args:
        action: `"warn"` (a `UserWarning`), `"stop"` (warn, then set
            `model.stop_training`, ending `fit` after this batch) or
            `"raise"` (a `RuntimeError` out of `fit`). Defaults to `"warn"`.
        check_nonfinite: Bool. Report non-finite gradients. Defaults to
            `True`.
        min_loss_scale: Float or None. See above; None counts every
            non-finite step, also under a `LossScaleOptimizer`. Defaults to
            `1.0`.
        vanishing_threshold: Float or None. Per-layer norm under which a
            layer counts as vanishing; None turns the check off. Defaults to
            `None`.
        vanishing_steps: Int. Checks in a row below `vanishing_threshold`
            before a layer is reported. Defaults to `10`.
        exploding_threshold: Float or None. Global-norm ceiling; None turns
            it off. Defaults to `None`.
        exploding_factor: Float above 1, or None. Report a global norm above
            this many times the running median; None turns it off. Defaults
            to `None`.
        median_window: Int. How many recent finite global norms the median
            covers. Defaults to `100`.
        check_freq: Int. Check every this many training batches. Defaults to
            `1`.

    Raises:
        ValueError: On an invalid argument.
        TypeError: The model does not keep gradients (at the start of `fit`).

    Example:

    ```python
    monitor = kg.callbacks.GradientMonitor(action="stop",
                                           exploding_factor=10.0)
    model.fit(x, y, callbacks=[monitor])
    monitor.events
    # [{'kind': 'nonfinite', 'step': 7, 'epoch': 0, 'layers': ['dense_1'],
    #   'message': 'Step 7: non-finite gradients (NaN or inf) in 1 of 3 ...'}]
    ```
    """

    def __init__(
        self,
        action="warn",
        check_nonfinite=True,
        min_loss_scale=1.0,
        vanishing_threshold=None,
        vanishing_steps=10,
        exploding_threshold=None,
        exploding_factor=None,
        median_window=100,
        check_freq=1,
    ):
        super().__init__()
        if action not in _ACTIONS:
            raise ValueError(
                f"`action` must be one of {list(_ACTIONS)}. Received: action={action!r}"
            )
        self.action = action
        self.check_nonfinite = _check_bool("check_nonfinite", check_nonfinite)
        self.min_loss_scale = _check_positive_float("min_loss_scale", min_loss_scale)
        self.vanishing_threshold = _check_positive_float(
            "vanishing_threshold", vanishing_threshold
        )
        self.vanishing_steps = _check_positive_int("vanishing_steps", vanishing_steps)
        self.exploding_threshold = _check_positive_float(
            "exploding_threshold", exploding_threshold
        )
        self.exploding_factor = _check_positive_float(
            "exploding_factor", exploding_factor, above=1.0
        )
        self.median_window = _check_positive_int("median_window", median_window)
        self.check_freq = _grad_stats.check_frequency(
            "check_freq", check_freq, allow_epoch=False, allow_batch=False
        )
        self.events = []
        self._steps = _grad_stats.StepCounter()
        self._epoch = 0

    def on_train_begin(self, logs=None):
        _grad_stats.require_kept_gradients(self.model, "GradientMonitor")
        self._steps.begin_train()
        self._norms = _grad_stats.GradientNorms(_trainable_paths(self.model))
        n_layers = len(self._norms.layers)
        self._below = np.zeros(n_layers, np.int64)
        self._vanished = np.zeros(n_layers, bool)
        self._recent = deque(maxlen=self.median_window)
        self._nonfinite_active = False
        self._exploding_active = False
        self.events = []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps.begin_epoch()

    def on_train_batch_end(self, batch, logs=None):
        previous = self._steps.end_batch(batch, self.params)
        if not _grad_stats.crossed(previous, self._steps.step, self.check_freq):
            return
        norms = self._norms(self.model.get_gradients_by_path())
        if self.check_nonfinite:
            self._check_nonfinite(norms)
        if self.vanishing_threshold is not None:
            self._check_vanishing(norms)
        if self.exploding_threshold is not None or self.exploding_factor is not None:
            self._check_exploding(norms)

    def _names(self, indices, values=None, limit=5):
        layers = self._norms.layers
        shown = [
            repr(layers[i]) if values is None else f"{layers[i]!r} ({values[i]:.4g})"
            for i in indices[:limit]
        ]
        more = len(indices) - limit
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")

    def _check_nonfinite(self, norms):
        if not norms.nonfinite:
            self._nonfinite_active = False
            return
        note = ""
        optimizer = self.model.optimizer
        if (
            isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and self.min_loss_scale is not None
        ):
            scale = _grad_stats.loss_scale_of(optimizer)
            if scale >= self.min_loss_scale:
                return  # The optimizer skipped the step and lowered its scale.
            note = f" The loss scale fell to {scale:g}, below min_loss_scale={self.min_loss_scale:g}."
        if self._nonfinite_active:
            return
        self._nonfinite_active = True
        bad = np.flatnonzero(norms.layer_nonfinite)
        self._report(
            "nonfinite",
            bad,
            f"non-finite gradients (NaN or inf) in {len(bad)} of "
            f"{len(self._norms.layers)} layers, in forward order: "
            f"{self._names(bad)}.{note}",
        )

    def _check_vanishing(self, norms):
        values = norms.layer_norms
        low = np.isfinite(values) & (values < self.vanishing_threshold)
        self._below = np.where(low, self._below + 1, 0)
        self._vanished &= low
        new = np.flatnonzero((self._below >= self.vanishing_steps) & ~self._vanished)
        if new.size:
            self._vanished[new] = True
            self._report(
                "vanishing",
                new,
                f"vanishing gradients: the gradient norm of {self._names(new, values)} "
                f"stayed below vanishing_threshold={self.vanishing_threshold:g} "
                f"for {self.vanishing_steps} checks in a row.",
            )

    def _check_exploding(self, norms):
        value = norms.global_norm
        if not np.isfinite(value):
            return
        reason = None
        if self.exploding_threshold is not None and value > self.exploding_threshold:
            reason = f"above exploding_threshold={self.exploding_threshold:g}"
        elif self.exploding_factor is not None and len(self._recent) >= min(
            10, self.median_window
        ):
            median = float(np.median(self._recent))
            if value > self.exploding_factor * median:
                reason = (
                    f"above exploding_factor={self.exploding_factor:g} times the "
                    f"median of the last {len(self._recent)} ({median:.4g})"
                )
        self._recent.append(value)
        if reason is None:
            self._exploding_active = False
            return
        if self._exploding_active:
            return
        self._exploding_active = True
        layers = norms.layer_norms
        largest = np.argsort(-np.nan_to_num(layers, nan=-1.0), kind="stable")[:3]
        self._report(
            "exploding",
            largest,
            f"exploding gradients: global norm {value:.4g} is {reason}; "
            f"largest layer norms: {self._names(largest, layers)}.",
        )

    def _report(self, kind, indices, text):
        step = self._steps.step
        message = f"Step {step}: {text}"
        self.events.append(
            {
                "kind": kind,
                "step": step,
                "epoch": self._epoch,
                "layers": [self._norms.layers[i] for i in indices],
                "message": message,
            }
        )
        if self.action == "raise":
            raise RuntimeError(f"GradientMonitor: {message}")
        if self.action == "stop":
            warnings.warn(f"GradientMonitor: {message} Stopping training.", stacklevel=3)
            self.model.stop_training = True
        else:
            warnings.warn(f"GradientMonitor: {message}", stacklevel=3)


_RESERVED_KEYS = ("step", "epoch", "loss_scale")


class GradientSnapshot(keras.callbacks.Callback):
    """Writes the kept gradients to `.npz` files for offline analysis.

    Each file holds one array per trainable variable, keyed by its path
    (`"dense_0/kernel"`), as `model.get_gradients_by_path()` returns it
    (bfloat16 is stored as float32, which NumPy can read), and three
    scalars: `step` (training batches run in this `fit`), `epoch` (1-based,
    as in the file name) and `loss_scale` (a `LossScaleOptimizer`'s dynamic
    scale read after the step, else the optimizer's `loss_scale_factor`,
    else 1.0; the gradients are already unscaled).

    A file is never half-written: it is written to a temporary file in the
    same directory, then renamed over the target. Without `{step}` or
    `{epoch}` in `path`, each snapshot replaces the previous one. A write
    that fails during `fit` is warned about and training goes on.

    Args:
        path: Str or path ending in `.npz`. May hold the fields `{step}`
            and `{epoch}`, with format specs: `"grads/{step:06d}.npz"`.
        every: `"epoch"` (the epoch's last batch) or a positive int (every
            this many training batches). Defaults to `"epoch"`.

    Raises:
        ValueError: On an invalid `path` or `every`; when the directory
            of `path` is not writable (raised before training starts).
        TypeError: The model does not keep gradients (at the start of `fit`).

    Example:

    ```python
    snapshot = kg.callbacks.GradientSnapshot("grads/{step:05d}.npz", every=100)
    model.fit(x, y, epochs=3, callbacks=[snapshot])
    data = np.load(snapshot.files[-1])
    data["dense_0/kernel"], int(data["step"]), float(data["loss_scale"])
    ```
    """

    def __init__(self, path, every="epoch"):
        super().__init__()
        self.path = os.fspath(path)
        self.every = _grad_stats.check_frequency("every", every, allow_batch=False)
        if not self.path.endswith(".npz"):
            raise ValueError(
                "`path` must end in '.npz' (e.g. 'grads/{step:06d}.npz'). "
                f"Received: path={self.path!r}"
            )
        try:
            self.path.format(step=0, epoch=1)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                "`path` may only hold the fields {step} and {epoch} (with "
                f"format specs like {{step:06d}}). Received: path={self.path!r} "
                f"({type(error).__name__}: {error})"
            ) from error
        self.files = []
        self._steps = _grad_stats.StepCounter()
        self._epoch = 0

    def on_train_begin(self, logs=None):
        _grad_stats.require_kept_gradients(self.model, "GradientSnapshot")
        clashes = sorted(set(_trainable_paths(self.model)) & set(_RESERVED_KEYS))
        if clashes:
            raise ValueError(
                f"GradientSnapshot stores {list(_RESERVED_KEYS)} beside the "
                f"variable paths, but the model has variables named {clashes}. "
                "Rename them."
            )
        directory = os.path.dirname(os.path.abspath(self.path.format(step=0, epoch=1)))
        _grad_stats.check_writable_dir(directory, "path", self.path)
        self._steps.begin_train()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps.begin_epoch()
        self._epoch_first_step = self._steps.step

    def on_train_batch_end(self, batch, logs=None):
        previous = self._steps.end_batch(batch, self.params)
        if self.every != "epoch" and _grad_stats.crossed(
            previous, self._steps.step, self.every
        ):
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        if self.every == "epoch" and self._steps.step > self._epoch_first_step:
            self._write()

    def _write(self):
        step = self._steps.step
        filename = self.path.format(step=step, epoch=self._epoch + 1)
        arrays = {}
        for path, grad in self.model.get_gradients_by_path().items():
            if grad.dtype == tf.bfloat16:
                grad = tf.cast(grad, tf.float32)
            arrays[path] = grad.numpy()
        arrays["step"] = np.int64(step)
        arrays["epoch"] = np.int64(self._epoch + 1)
        arrays["loss_scale"] = np.float64(
            _grad_stats.loss_scale_of(self.model.optimizer)
        )
        try:
            _atomic_savez(filename, arrays)
        except OSError as error:
            warnings.warn(
                f"GradientSnapshot could not write {filename!r}: {error}. "
                "Training continues.",
                stacklevel=2,
            )
            return
        self.files.append(filename)


def _atomic_savez(filename, arrays):
    """`np.savez` to a temporary file beside `filename`, then rename."""
    directory = os.path.dirname(os.path.abspath(filename))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(
        directory, f".{os.path.basename(filename)}.{uuid.uuid4().hex[:12]}.tmp"
    )
    # `os.open` with 0o666 (not `mkstemp`'s 0o600): the final file gets the
    # permissions a plain `np.savez` would give it.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, filename)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
