"""`GradientTensorBoard`: Keras's TensorBoard plus the gradient panels.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.

TensorFlow writes the events on every backend, as for Keras's own
TensorBoard callback; it is imported where they are written, not at the
top, so that importing the package loads it only on its own backend.
"""

import os
import time
import warnings
from typing import Any

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad.callbacks import _reading
from keras_keepgrad.callbacks import _skipped
from keras_keepgrad.callbacks import heatmap
from keras_keepgrad.callbacks import panels
from keras_keepgrad.metrics.compiled import tensorboard_charts

__all__ = ["GradientTensorBoard"]

# The heatmap figure may take at most this share of a `fit`'s time, except
# at its last epoch (see `GradientTensorBoard._heatmap_due`).
_HEATMAP_SHARE = 0.02


class GradientTensorBoard(_reading.KeptStepReader, keras.callbacks.TensorBoard):
    """A `keras.callbacks.TensorBoard` that also draws the kept gradients.

    Writes everything `keras.callbacks.TensorBoard` writes, and under
    `log_dir/train`:

    - `gradients/log10_norm/<layer>`: log10 of the L2 norm of each
      layer's gradients (-6 reads 1e-6, where a linear value table shows
      0), the tag named by the layer's path alone, so that a layer has the
      same tag in every run and model; and `gradients/log10_global_norm`,
      log10 of the norm over all of them. Every `update_freq` batches (with
      `"epoch"`: at each epoch end, from the epoch's last batch), at the
      training-batch step. NaN at a non-finite step (the global norm, and
      each layer whose gradients hold NaN or inf), which TensorBoard's
      charts mark with a triangle; -inf for an all-zero gradient.
    - `gradients/nonfinite_steps`: how many recorded steps of this `fit`
      had NaN or inf gradients so far, as a step function: written at the
      first recorded step, where it changes (and, if not yet written, at
      the recorded step before, so that the line stays flat up to the
      change) and at the last recorded step of each epoch, not as a stream
      of zeros. Under a `keras.optimizers.LossScaleOptimizer`
      also `gradients/skipped_steps` (the steps it skipped since `fit`
      began) and `gradients/loss_scale`, written with the norms but
      describing the optimizer when they are written: at the current
      training-batch step, which under `keep_every` can be later than the
      kept step the norms are labelled with.
    - `<variable path>/gradient`: histograms of the finite gradient values,
      beside Keras's `<variable path>/histogram` of the weights (the same
      TensorBoard category; Keras before 3.14 names those by the weight's
      name alone); every `histogram_freq` epochs from the epoch's
      last batch, at the epoch step, or with `gradient_histogram_freq=N`
      every N training batches, at the batch step. Where the gradient held
      NaN or inf, also `<variable path>/gradient_nonfinite`: -1 per -inf
      entry, 0 per NaN, +1 per +inf (an all-non-finite step leaves the
      gradient slice empty; this marks it). Beside them,
      `<variable path>/gradient_log10_abs`: histograms of log10 of the
      magnitude of the finite, non-zero entries (a vanishing layer's
      gradient of about 1e-7 reads -7, where TensorBoard's labels of its
      tiny linear range overlap).
    - `gradients/heatmap`: at each epoch end once a step was recorded
      (with an integer `update_freq`, not before that many steps; drawing
      takes about 0.1 s, so in a `fit` of many short epochs only while that
      stays under 2% of the training time, and always at the last epoch or
      when `fit` stops early), a figure of log10 layer norms: layers (rows, forward order, named) by
      training step, for the whole run so far, on one fixed log10 color
      scale for every run (1e-8 to 1e4; beyond it the end colors, hatched),
      the vanishing and exploding thresholds marked on the color bar, zero
      black and NaN/inf red (named in its legend), a dashed line at the
      first non-finite step, and the named layers' last norms on the right;
      1200 x 446 pixels, readable at TensorBoard's default image size. At most 1024 columns, each
      the geometric mean of the same number of recorded steps (doubled as
      the run grows; the last column may hold fewer).
    - A custom-scalars layout, "Gradient panels": one chart of the global
      log10 norm and every layer's, in forward order (one y axis for all,
      so a flat layer looks flat), then one of the non-finite (and
      skipped) steps. Past 16 layers, a category "Gradient panels: layers
      in forward order" adds charts of consecutive blocks of at most 16
      layers, each with the global norm. Under a `LossScaleOptimizer` also
      a category "Gradient panels: loss scale".

    Each tag's summary metadata (with the description TensorBoard shows)
    is written with its first value only.

    Frequent scalars (and Keras's own batch logs, same tags and steps) are
    written through one buffered writer: at most 1 s or 256 rows late, and
    always at each epoch end, when `fit` ends, at once for a step with a
    non-finite value, and before `GradientMonitor(action="raise")` raises.
    An error raised elsewhere can leave up to 1 s of rows unwritten.

    Layers are variable paths minus their last component; see the module
    docstring, also for steps under `steps_per_execution`.

    Cost: the norms come from statistics the training step computes once
    (`keras_keepgrad._stats`) and this callback reads as one small vector
    per recorded step; see `benchmarks/run.py tensorboard --setup batch`
    and `--setup epoch`. Histograms read every gradient.

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
        gradient_histogram_freq: None or a positive int. With an int, write
            the gradient histograms every this many training batches
            instead of with the weight histograms. Defaults to `None`.
        **kwargs: Passed on to `keras.callbacks.TensorBoard`
            (`write_graph`, `write_images`, `profile_batch`, ...).

    Raises:
        ValueError: On an invalid `update_freq`, `histogram_freq` or
            `gradient_histogram_freq`; when
            `log_dir` is not writable, or the model was built with
            `keep_gradients=False` (both at the start of `fit`).
        TypeError: The model is not a `KeepGradModel` (at the start of `fit`).

    Examples:
        ```python
        model = kg.KeepGradModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, epochs=5, callbacks=[
            kg.callbacks.GradientTensorBoard("logs", update_freq=10,
                                             histogram_freq=1)])
        # tensorboard --logdir logs  ->  Custom Scalars: "Gradient panels"
        ```
    """

    _callback_name = "GradientTensorBoard"

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        histogram_freq: int = 0,
        update_freq: str | int = "epoch",
        write_heatmap: bool = True,
        gradient_histogram_freq: int | None = None,
        **kwargs: Any,
    ) -> None:
        update_freq = _checks.check_frequency("update_freq", update_freq)
        histogram_freq = _checks.check_non_negative_int("histogram_freq", histogram_freq)
        if gradient_histogram_freq is not None:
            gradient_histogram_freq = _checks.check_frequency(
                "gradient_histogram_freq", gradient_histogram_freq, allow_epoch=False
            )
        super().__init__(
            log_dir=log_dir,
            histogram_freq=histogram_freq,
            update_freq=update_freq,
            **kwargs,
        )
        self.write_heatmap = _checks.check_bool("write_heatmap", write_heatmap)
        self.gradient_histogram_freq = gradient_histogram_freq
        self._batch_logs = None
        self._heatmap = None
        self._layout_written = False
        self._warned = False

    def set_model(self, model):
        # Before making the log directory: a plain model gets nothing
        # written. (`keep_gradients=False` is refused at `on_train_begin`, so
        # that `evaluate` still takes the callback.)
        if not hasattr(model, "get_gradients_by_path"):
            _checks.require_kept_gradients(model, "GradientTensorBoard")
        # Fail at `fit`'s start with a clear message, not from the writer.
        _checks.check_writable_dir(os.path.join(self.log_dir, "train"), "log_dir", self.log_dir)
        super().set_model(model)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._heatmap = heatmap.Heatmap()
        self._train_began = time.monotonic()
        self._heatmap_seconds = 0.0  # spent drawing it in this `fit`
        self._heatmap_last = 0.2  # seconds the last figure took (a guess above it)
        self._heatmap_pending = None  # an epoch whose figure was skipped
        optimizer = self.model.optimizer
        self._loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # The inner optimizer's iterations only advance on applied steps; under
        # gradient accumulation they count updates, not steps.
        self._count_skipped = self._loss_scaled and not getattr(
            optimizer.inner_optimizer, "gradient_accumulation_steps", None
        )
        self._iterations_at_begin = int(optimizer.iterations.numpy()) if self._count_skipped else 0
        traced = self.update_freq != "epoch"
        self._scalars = self._norm_writer()
        self._nonfinite_steps = 0
        self._nonfinite = panels.StepFunctionWriter(
            self._train_writer,
            panels.NONFINITE_TAG,
            traced=traced,
            description=panels.NONFINITE_DESCRIPTION,
        )
        # The optimizer's scalars describe it now, not the kept step (which
        # under `keep_every` may be older): a writer of their own.
        optimizer_tags = []
        if self._loss_scaled:
            optimizer_tags.append(panels.LOSS_SCALE_TAG)
        if self._count_skipped:
            optimizer_tags.append(panels.SKIPPED_STEPS_TAG)
        self._optimizer_scalars = (
            panels.ScalarWriter(self._train_writer, optimizer_tags, traced=traced)
            if optimizer_tags
            else None
        )
        self._batch_logs = None
        self._histogram_step = None

    def _norm_writer(self):
        """The writer of the norms of the layers `self._norms` reads.

        The global norm first, then the layers in forward order: the order
        in which a run first writes its tags is the order of the lines in
        the custom-scalars overview chart.
        """
        layers = self._norms.layers
        tags = [panels.GLOBAL_NORM_TAG] + [panels.layer_norm_tag(layer) for layer in layers]
        descriptions = [panels.GLOBAL_NORM_DESCRIPTION]
        descriptions += [panels.LAYER_NORM_DESCRIPTION] * len(layers)
        traced = self.update_freq != "epoch"
        return panels.ScalarWriter(
            self._train_writer, tags, traced=traced, descriptions=descriptions
        )

    def _follow(self, model=None, kept=None):
        """Once the step is traced, its kept layers are the panels' layers.

        Before, at the first `fit`'s start, they are taken to be the
        trainable ones; the layout is written once they are known, so that
        it shows no chart a step never fills. A step that keeps other
        layers than the last (an eager step whose optimizers vary) changes
        them again (`_on_layers_changed`).
        """
        super()._follow(model, kept)
        if not self._layout_written:
            self._layout_written = True
            self._guarded(self._write_layout)

    def _on_layers_changed(self):
        # The heatmap, whose rows are the layers, starts over.
        self._guarded(self._scalars.flush)
        self._scalars = self._norm_writer()
        if self._heatmap.columns:
            self._heatmap = heatmap.Heatmap()

    def _scalar_writers(self):
        return [
            w
            for w in (self._scalars, self._nonfinite, self._optimizer_scalars, self._batch_logs)
            if w is not None
        ]

    def _flush_scalars(self):
        for writer in self._scalar_writers():
            writer.flush()

    def on_train_end(self, logs=None):
        # Before Keras closes the writers.
        self._follow()
        self._guarded(self._flush_scalars)
        if self._heatmap_pending is not None:  # stopped before the last epoch
            self._guarded(self._write_heatmap, self._heatmap_pending)
        super().on_train_end(logs)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._epoch_first_step = self._steps.step

    def on_train_batch_end(self, batch, logs=None):
        # Keras writes each batch log with an eager `tf.summary.scalar`; the
        # same tags, steps and values go through one buffered writer here
        # (`_write_batch_logs`), the rest of Keras's batch work as it is;
        # the norms are read here at `update_freq`, not at every batch.
        keras.callbacks.TensorBoard.on_train_batch_end(self, batch, None)
        if isinstance(logs, dict) and self.update_freq != "epoch":
            self._guarded(self._write_batch_logs, logs)
        previous = self._advance(batch, logs)
        self._guarded(_skipped.mark, self._train_writer, self._skips.new, self._steps.step)
        if self.update_freq != "epoch" and _reading.crossed(
            previous, self._steps.step, self.update_freq
        ):
            self._guarded(self._record)
        if self.gradient_histogram_freq is not None and _reading.crossed(
            previous, self._steps.step, self.gradient_histogram_freq
        ):
            step = self._new_histogram_step()
            if step is not None:
                self._guarded(self._write_histograms, step)

    def _write_batch_logs(self, logs):
        # As Keras 3.15: at its execution count, when it is a multiple of
        # `update_freq`.
        step = self._global_train_batch
        if step % self.update_freq:
            return
        names = tuple(logs)
        if self._batch_logs is None or self._batch_names != names:
            if self._batch_logs is not None:
                self._batch_logs.flush()
            self._batch_names = names
            self._batch_logs = panels.ScalarWriter(
                self._train_writer, [f"batch_{n}" for n in names], traced=True
            )
        values = [float(np.asarray(logs[n])) for n in names]
        self._batch_logs.write(step, values, now=not np.isfinite(values).all())

    def on_epoch_end(self, epoch, logs=None):
        import tensorflow as tf

        # Keras 3.15 leaves its batch-level `record_if` (counting executions)
        # active here, so with an integer `update_freq` it silently drops the
        # epoch metrics and weight histograms of some epochs.
        with tf.summary.record_if(True):
            super().on_epoch_end(epoch, logs)
        if self._steps.step == 0:
            return
        self._follow()
        if self.update_freq == "epoch" and self._steps.step > self._epoch_first_step:
            self._logs = None
            self._guarded(self._record)
        self._guarded(self._flush_scalars)
        if not self._norms.paths:
            return  # No trainable variables: no gradients to draw.
        if (
            self.gradient_histogram_freq is None
            and self.histogram_freq
            and epoch % self.histogram_freq == 0
        ):
            self._guarded(self._write_histograms, epoch)
        if self.write_heatmap and self._heatmap.columns:
            if self._heatmap_due(epoch):
                self._guarded(self._write_heatmap, epoch)
            else:
                self._heatmap_pending = epoch
        self._guarded(self._train_writer.flush)

    def _heatmap_due(self, epoch):
        """Whether to draw the figure at this epoch's end.

        Drawing it takes about 0.1 s. In a `fit` of many short epochs it is
        drawn only while that keeps below `_HEATMAP_SHARE` of the training
        time, and always at the last epoch (or when `fit` ends early).
        """
        last = epoch + 1 >= (self.params or {}).get("epochs", epoch + 1)
        elapsed = time.monotonic() - self._train_began
        # The next figure is expected to cost what the last one did.
        expected = self._heatmap_seconds + self._heatmap_last
        return last or expected <= _HEATMAP_SHARE * elapsed

    def _guarded(self, fn, *args):
        # A TensorBoard problem is warned about once, never raised mid-`fit`.
        import tensorflow as tf

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
        import tensorflow as tf

        with self._train_writer.as_default(), tf.summary.record_if(True):
            charts = tensorboard_charts(self.model)
            if not panels.write_layout(
                self._norms.layers, self._loss_scaled, self._count_skipped, charts
            ):
                warnings.warn(
                    "The `tensorboard` package is not installed: "
                    "GradientTensorBoard writes no custom-scalars layout.",
                    stacklevel=3,
                )

    def _record(self):
        model = _reading.unsynced_model(self)
        kept = model.kept_step
        self._follow(model, kept)
        self._read_kept(model, kept)

    def _on_kept_step(self, step, epoch, norms):
        layer_norms = np.asarray(norms.layer_norms, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.append(norms.global_norm, layer_norms))
        # A non-finite layer (and the global norm) reads NaN, which
        # TensorBoard marks with a triangle, where its norm may be inf.
        logs[1:][norms.layer_nonfinite] = np.nan
        if norms.nonfinite:
            logs[0] = np.nan
            self._nonfinite_steps += 1
        # A non-finite step is written at once: an error may end `fit` next.
        self._scalars.write(step, logs, now=norms.nonfinite)
        self._nonfinite.add(step, self._nonfinite_steps, now=norms.nonfinite)
        self._heatmap.add(step, norms.layer_norms)
        if self._optimizer_scalars is not None:
            now = self._steps.step
            optimizer = self.model.optimizer
            values = []
            if self._loss_scaled:
                values.append(_reading.loss_scale_of(optimizer))
            if self._count_skipped:
                applied = int(optimizer.iterations.numpy()) - self._iterations_at_begin
                values.append(now - applied)
            self._optimizer_scalars.write(now, values)

    def _new_histogram_step(self):
        """The step of the kept gradients, or None if already drawn."""
        kept = _reading.unsynced_model(self).kept_step
        step = self._steps.step - (0 if kept is None else kept.age)
        if step == self._histogram_step:
            return None
        self._histogram_step = step
        return step

    def _write_histograms(self, step):
        import tensorflow as tf

        model = _reading.unsynced_model(self)
        if self._new.nothing_kept(model):
            return
        grads = _reading.readable_gradients(model)
        with self._train_writer.as_default(), tf.summary.record_if(True):
            for path, grad in grads.items():
                values = tf.reshape(grad, [-1])
                finite = tf.math.is_finite(values)
                all_finite = bool(tf.reduce_all(finite))
                finite_values = values if all_finite else tf.boolean_mask(values, finite)
                tf.summary.histogram(
                    panels.histogram_tag(path),
                    finite_values,
                    step=step,
                    description=panels.HISTOGRAM_DESCRIPTION,
                )
                # The same entries by magnitude, in decades: TensorBoard's
                # axis labels of a tiny linear range overlap.
                magnitudes = tf.abs(tf.cast(finite_values, tf.float64))
                tf.summary.histogram(
                    panels.log10_histogram_tag(path),
                    tf.math.log(tf.boolean_mask(magnitudes, magnitudes > 0)) / np.log(10.0),
                    step=step,
                    description=panels.LOG10_HISTOGRAM_DESCRIPTION,
                )
                if not all_finite:
                    tf.summary.histogram(
                        panels.nonfinite_histogram_tag(path),
                        panels.nonfinite_kinds(values),
                        step=step,
                        description=panels.NONFINITE_HISTOGRAM_DESCRIPTION,
                    )

    def _write_heatmap(self, epoch):
        import tensorflow as tf

        start = time.monotonic()
        self._heatmap_pending = None
        image = heatmap.render_heatmap(self._heatmap, self._norms.layers)
        self._heatmap_last = time.monotonic() - start
        self._heatmap_seconds += self._heatmap_last
        with self._train_writer.as_default(), tf.summary.record_if(True):
            tf.summary.image(
                panels.HEATMAP_TAG,
                image,
                step=epoch,
                description=panels.HEATMAP_DESCRIPTION,
            )
