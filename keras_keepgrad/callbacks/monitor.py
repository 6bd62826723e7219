"""`GradientMonitor`: alarms on non-finite, vanishing and exploding gradients.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.
"""

import warnings
from collections import deque

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad import _stats
from keras_keepgrad.callbacks import _reading
from keras_keepgrad.callbacks import panels

__all__ = ["GradientMonitor"]

_ACTIONS = ("warn", "stop", "raise")


class GradientMonitor(keras.callbacks.Callback):
    """Watches the kept gradients for NaN, vanishing and exploding layers.

    Every `check_freq` training batches it looks at the gradients kept for
    the last batch and reports:

    - non-finite gradients (NaN or inf), naming the affected layers in
      forward order (the first listed is the earliest layer whose gradients
      are not finite);
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

    Attributes:
        events: List of dicts, one per report of the last `fit`: `kind`
            (`"nonfinite"`, `"vanishing"` or `"exploding"`), `step`, `epoch`
            (0-based, the epoch in which `step` ran), `layers` (names) and
            `message`.

    Raises:
        ValueError: On an invalid argument; when the model was built with
            `keep_gradients=False` (at the start of `fit`).
        TypeError: The model is not a `KeepGradModel` (at the start of `fit`).

    Examples:
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
        action: str = "warn",
        check_nonfinite: bool = True,
        min_loss_scale: float | None = 1.0,
        vanishing_threshold: float | None = None,
        vanishing_steps: int = 10,
        exploding_threshold: float | None = None,
        exploding_factor: float | None = None,
        median_window: int = 100,
        check_freq: int = 1,
    ) -> None:
        super().__init__()
        if action not in _ACTIONS:
            raise ValueError(
                f"`action` must be one of {list(_ACTIONS)}. Received: action={action!r}"
            )
        self.action = action
        self.check_nonfinite = _checks.check_bool("check_nonfinite", check_nonfinite)
        self.min_loss_scale = _checks.check_positive_float("min_loss_scale", min_loss_scale)
        self.vanishing_threshold = _checks.check_positive_float(
            "vanishing_threshold", vanishing_threshold
        )
        self.vanishing_steps = _checks.check_positive_int("vanishing_steps", vanishing_steps)
        self.exploding_threshold = _checks.check_positive_float(
            "exploding_threshold", exploding_threshold
        )
        self.exploding_factor = _checks.check_positive_float(
            "exploding_factor", exploding_factor, above=1.0
        )
        self.median_window = _checks.check_positive_int("median_window", median_window)
        self.check_freq = _checks.check_frequency(
            "check_freq", check_freq, allow_epoch=False, allow_batch=False
        )
        self.events = []
        self._steps = _reading.StepCounter()
        self._new = _reading.NewGradients(self)
        self._step = 0
        self._logs = None

    def set_model(self, model):
        super().set_model(model)
        # Before `fit` makes the training function: it records the norms.
        _stats.require(model)

    def on_train_begin(self, logs=None):
        _checks.require_kept_gradients(self.model, "GradientMonitor")
        self._steps.begin_train()
        self._new.begin(self.model)
        self._norms = _reading.LatestNorms(self.model)
        self._count_layers()
        self._recent = deque(maxlen=self.median_window)
        self._nonfinite_active = False
        self._exploding_active = False
        self.events = []

    def _count_layers(self):
        n_layers = len(self._norms.layers)
        self._below = np.zeros(n_layers, np.int64)
        self._vanished = np.zeros(n_layers, bool)

    def on_epoch_begin(self, epoch, logs=None):
        self._steps.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._logs = logs if isinstance(logs, dict) else None
        previous = self._steps.end_batch(batch, self.params)
        model = _reading.unsynced_model(self)
        kept = model.kept_step
        if self._norms.follow(model, kept):
            self._count_layers()  # the step kept fewer layers than it trains
        if not self._norms.paths or not _reading.crossed(
            previous, self._steps.step, self.check_freq
        ):
            return
        self._step = self._new.step_of(model, self._steps.step, kept)
        if self._step is None:
            return  # `keep_every`: nothing kept since the last check
        norms = self._norms.read(model, self._logs)
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
            scale = _reading.loss_scale_of(optimizer)
            if scale >= self.min_loss_scale:
                return  # The optimizer skipped the step and lowered its scale.
            note = (
                f" The loss scale fell to {scale:g}, below min_loss_scale={self.min_loss_scale:g}."
            )
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
        elif self.exploding_factor is not None and len(self._recent) >= min(10, self.median_window):
            median = float(np.median(self._recent))
            if median > 0 and value > self.exploding_factor * median:
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
        step = self._step
        message = f"Step {step}: {text}"
        self.events.append(
            {
                "kind": kind,
                "step": step,
                "epoch": self._steps.epoch_of(step),
                "layers": [self._norms.layers[i] for i in indices],
                "message": message,
            }
        )
        if self.action == "raise":
            # `fit` ends without `on_train_end`: write the buffered panels.
            panels.flush_all()
            raise RuntimeError(f"GradientMonitor: {message}")
        if self.action == "stop":
            warnings.warn(f"GradientMonitor: {message} Stopping training.", stacklevel=3)
            self.model.stop_training = True
        else:
            warnings.warn(f"GradientMonitor: {message}", stacklevel=3)
