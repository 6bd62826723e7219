"""`GradientMonitor`: alarms on non-finite, vanishing and exploding gradients.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.
"""

import warnings
from collections import deque

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad import _replicas
from keras_keepgrad.callbacks import _health
from keras_keepgrad.callbacks import _reading
from keras_keepgrad.callbacks import _states
from keras_keepgrad.callbacks import panels

__all__ = ["GradientMonitor"]

_ACTIONS = ("warn", "stop", "raise")


class GradientMonitor(_reading.KeptStepReader):
    """Watches the kept gradients for NaN, vanishing and exploding layers.

    Every `check_freq` training batches it looks at the gradients kept for
    the last batch and reports:

    - non-finite gradients (NaN or inf), naming the affected layers in
      forward order (the first listed is the earliest layer whose gradients
      are not finite), and under several replicas the first replica whose
      share went bad (`model.first_bad_replica`: "first on replica 1 of 2");
    - vanishing layers: a layer's gradient norm stayed below
      `vanishing_threshold` for `vanishing_steps` checks in a row;
    - explosions: the global gradient norm is above `exploding_threshold`,
      or above `exploding_factor` times the median of the last
      `median_window` global norms (once at least `min(10, median_window)`
      are known), naming the layers with the largest norms;
    - skipped steps: a step whose optimizer update `skip_bad_steps`
      skipped (`kg.SkipBadSteps`), naming its non-finite layers in forward
      order, or for a spike the layers with the largest norms. The model
      is intact (its weights and optimizer state are as before the step),
      so this is only warned about, whatever `action` says; such a step is
      reported as skipped, not as non-finite or exploding (it neither
      begins, extends nor ends such a state).

    By default all four are on: a layer vanishes below `1e-5` and the
    global norm explodes above `1e3`, the thresholds marked on
    `GradientTensorBoard`'s heatmap color bar and used by `GradientReport`'s
    verdicts (`kg.callbacks.VANISHING_THRESHOLD`,
    `kg.callbacks.EXPLODING_THRESHOLD`).

    A problem is a state, reported when it begins and when it ends. It
    begins as above; it ends once `recovery_steps` checks in a row were free
    of it (for a vanishing layer: at or above the threshold, or not
    finite), so that a norm hovering about a threshold makes one state, not
    one report per crossing. Both are reported as configured by `action`
    (the end only warns) and appended to `monitor.events`; at the end of
    `fit` one warning sums up every state of the run, with the steps it
    covered (`monitor.states`, `monitor.summary()`), unless `action` is
    `"raise"`.

    Under a `keras.optimizers.LossScaleOptimizer`, a non-finite step is
    normal: the optimizer skips it and halves its loss scale. Such steps only
    count once the scale has dropped below `min_loss_scale` (read after the
    step): from then on the scale no longer amplifies the gradients, so
    lowering it cannot help, and the non-finite values are the model's own.
    With the default 1.0 and Keras's initial scale of 2**15, persistent NaN
    is reported on the 16th skipped step in a row. This holds with
    `skip_bad_steps` too, which hands non-finite steps to the optimizer:
    only spikes it skips are reported as skipped there.

    Which steps `skip_bad_steps` skipped, the monitor learns from the
    `skipped_steps` that `fit` logs with each batch. With
    `steps_per_execution=N` that count covers the N steps of an execution;
    where it rose by fewer than N, a non-finite step counts as skipped if
    `model.skip_bad_steps.nonfinite` is set, a finite one as not skipped.

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
            `1e-5` (`VANISHING_THRESHOLD`).
        vanishing_steps: Int. Checks in a row below `vanishing_threshold`
            before a layer is reported. Defaults to `10`.
        exploding_threshold: Float or None. Global-norm ceiling; None turns
            it off. Defaults to `1e3` (`EXPLODING_THRESHOLD`).
        exploding_factor: Float above 1, or None. Report a global norm above
            this many times the running median; None turns it off. Defaults
            to `None`.
        median_window: Int. How many recent finite global norms the median
            covers. Defaults to `100`.
        check_freq: Int. Check every this many training batches. Defaults to
            `1`.
        recovery_steps: Int. Checks in a row free of a reported problem
            before its state ends (and can begin, and be reported, again).
            Defaults to `10`.
        check_skipped: Bool. Report the steps `skip_bad_steps` skipped.
            Whether on or off, a skipped step is not reported as non-finite
            or exploding. Defaults to `True`.

    Attributes:
        events: List of dicts, one per report of the last `fit`: `kind`
            (`"nonfinite"`, `"vanishing"`, `"exploding"` or `"skipped"` when
            a state begins; `"nonfinite_ended"`, `"vanishing_ended"`,
            `"exploding_ended"` or `"skipped_ended"` when it ends), `step` (of the check that
            reports it), `epoch` (0-based, the epoch in which `step` ran),
            `layers` (names), `message`, and `since`: the first step of the
            state. An end also has `until` (the state's last step) and
            `checks` (how many checks found the problem).
        states: List of dicts, one per state of the last `fit`, in the
            order they began: `kind`, `layers`, `since`, `until` (the last
            step found with the problem), `checks`, and `ongoing` (True
            while it has not ended; at the end of `fit`, whether it lasted
            to the end).

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
        #   'since': 7,
        #   'message': 'Step 7: non-finite gradients (NaN or inf) in 1 of 3 ...'}]
        print(monitor.summary())
        # 'dense_1' non-finite: steps 7-7 (1 check), until the end
        ```
    """

    _callback_name = "GradientMonitor"

    def __init__(
        self,
        action: str = "warn",
        check_nonfinite: bool = True,
        min_loss_scale: float | None = 1.0,
        vanishing_threshold: float | None = _health.VANISHING_THRESHOLD,
        vanishing_steps: int = 10,
        exploding_threshold: float | None = _health.EXPLODING_THRESHOLD,
        exploding_factor: float | None = None,
        median_window: int = 100,
        check_freq: int = 1,
        recovery_steps: int = 10,
        check_skipped: bool = True,
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
        self.recovery_steps = _checks.check_positive_int("recovery_steps", recovery_steps)
        self.check_skipped = _checks.check_bool("check_skipped", check_skipped)
        self.events = []
        self.states = []
        self._book = _states.States(self.recovery_steps, self._report)
        self._step = 0
        self._first_step = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._count_layers()
        self._recent = deque(maxlen=self.median_window)
        self._book = _states.States(self.recovery_steps, self._report)
        self.events = []
        self.states = self._book.all
        self._first_step = None
        self._last_step = None

    def _count_layers(self):
        n_layers = len(self._norms.layers)
        self._below = np.zeros(n_layers, np.int64)  # checks in a row below
        self._since = np.zeros(n_layers, np.int64)  # first step of that run
        self._vanishing = [None] * n_layers  # each layer's open state
        self._vanishing_open = np.zeros(n_layers, bool)

    def _on_layers_changed(self):
        self._count_layers()  # the step kept fewer layers than it trains

    def _read_due(self, previous):
        return _reading.crossed(previous, self._steps.step, self.check_freq)

    def _on_kept_step(self, step, epoch, norms):
        self._step = step
        if self._first_step is None:
            self._first_step = step
        self._last_step = step
        skipped = self._skipped_update(step, norms)
        if self.check_nonfinite:
            self._check_nonfinite(norms, skipped)
        if self.vanishing_threshold is not None:
            self._check_vanishing(norms)
        if self.exploding_threshold is not None or self.exploding_factor is not None:
            self._check_exploding(norms, skipped)
        if self.check_skipped:
            self._check_skipped(norms, skipped)

    def _skipped_update(self, step, norms):
        """Whether `skip_bad_steps` skipped the update of kept step `step`.

        Under a `LossScaleOptimizer` a non-finite step is the optimizer's to
        skip, with or without `skip_bad_steps`: `min_loss_scale` decides.
        """
        optimizer = _reading.unsynced_model(self).optimizer
        if norms.nonfinite and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return False
        return self._was_skipped(step, norms)

    def _names(self, indices, values=None, limit=5):
        layers = self._norms.layers
        shown = [
            repr(layers[i]) if values is None else f"{layers[i]!r} ({values[i]:.4g})"
            for i in indices[:limit]
        ]
        more = len(indices) - limit
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")

    def _nonfinite_text(self, bad):
        """What a report says of the non-finite layers `bad` (indices)."""
        return (
            f"non-finite gradients (NaN or inf) in {len(bad)} of "
            f"{len(self._norms.layers)} layers, in forward order: {self._names(bad)}"
            f"{_replicas.note(self.model)}."
        )

    def _largest(self, values, count=3):
        """The indices of the `count` layers of largest norm, largest first."""
        return np.argsort(-np.nan_to_num(values, nan=-1.0), kind="stable")[:count]

    def _check_nonfinite(self, norms, skipped):
        if not norms.nonfinite:
            self._book.recover("nonfinite")
            return
        if skipped:
            return  # A "skipped" state: neither begins, extends nor ends this one.
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
        if self._book.persist("nonfinite", self._step):
            return
        bad = np.flatnonzero(norms.layer_nonfinite)
        self._begin("nonfinite", bad, self._step, self._nonfinite_text(bad) + note)

    def _check_vanishing(self, norms):
        values = norms.layer_norms
        low = np.isfinite(values) & (values < self.vanishing_threshold)
        self._since = np.where(low & (self._below == 0), self._step, self._since)
        self._below = np.where(low, self._below + 1, 0)
        is_open = self._vanishing_open
        ended = []
        # Python only for the layers in a state: a check stays a few array
        # operations on a model of many healthy layers.
        for i in np.flatnonzero(is_open):
            state = self._vanishing[i]
            if low[i]:
                self._book.extend(state, self._step)
            elif self._book.clear(state):
                ended.append(i)
        new = np.flatnonzero(~is_open & (self._below >= self.vanishing_steps)).tolist()
        for i in ended:
            state, self._vanishing[i] = self._vanishing[i], None
            self._vanishing_open[i] = False
            self._book.end(
                state,
                f"the gradient norm of {self._names([i], values)} is no longer "
                f"below vanishing_threshold={self.vanishing_threshold:g}",
            )
        if not new:
            return
        # Layers that began together make one report, one state each.
        since = int(min(self._since[i] for i in new))
        state = self._begin(
            "vanishing",
            new,
            since,
            f"vanishing gradients: the gradient norm of {self._names(new, values)} "
            f"stayed below vanishing_threshold={self.vanishing_threshold:g} "
            f"for {self.vanishing_steps} checks in a row (since step {since}).",
            per_layer=True,
        )
        for i, layer_state in zip(new, state):
            layer_state["since"] = int(self._since[i])
            layer_state["checks"] = int(self._below[i])
            self._vanishing[i] = layer_state
            self._vanishing_open[i] = True

    def _check_exploding(self, norms, skipped):
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
            self._book.recover("exploding")
            return
        if skipped or self._book.persist("exploding", self._step):
            return
        layers = norms.layer_norms
        largest = self._largest(layers)
        self._begin(
            "exploding",
            largest,
            self._step,
            f"exploding gradients: global norm {value:.4g} is {reason}; "
            f"largest layer norms: {self._names(largest, layers)}.",
        )

    def _check_skipped(self, norms, skipped):
        if not skipped:
            self._book.recover("skipped")
            return
        if self._book.persist("skipped", self._step):
            return
        if norms.nonfinite:
            layers = np.flatnonzero(norms.layer_nonfinite)
            found = self._nonfinite_text(layers)
        else:
            layers = self._largest(norms.layer_norms)
            found = (
                f"global norm {norms.global_norm:.4g}; largest layer norms: "
                f"{self._names(layers, norms.layer_norms)}."
            )
        self._begin(
            "skipped",
            layers,
            self._step,
            f"skip_bad_steps skipped the update: {found} The weights and the "
            "optimizer's state are as they were before the step.",
        )

    def _begin(self, kind, indices, since, text, per_layer=False):
        """Opens a state (one per layer with `per_layer`) and reports it."""
        layers = [self._norms.layers[i] for i in indices]
        return self._book.begin(kind, layers, since, self._step, text, per_layer)

    def summary(self):
        """The states of the last `fit`, one line each, as a str."""
        return self._book.summary(self._first_step)

    def on_train_end(self, logs=None):
        self._book.finish()
        if self.states and self.action != "raise" and self._last_step is not None:
            warnings.warn(
                f"GradientMonitor: summary of steps {self._first_step}-{self._last_step}:\n"
                + self.summary(),
                stacklevel=2,
            )

    def _report(self, kind, layers, text, **extra):
        step = self._step
        message = f"Step {step}: {text}"
        self.events.append(
            {
                "kind": kind,
                "step": step,
                "epoch": self._steps.epoch_of(step),
                "layers": list(layers),
                "message": message,
                **extra,
            }
        )
        if kind.endswith("_ended") or kind == "skipped":
            # An end, or a step that left the model intact: only a warning.
            warnings.warn(f"GradientMonitor: {message}", stacklevel=3)
            return
        if self.action == "raise":
            # `fit` ends without `on_train_end`: write the buffered panels.
            panels.flush_all()
            raise RuntimeError(f"GradientMonitor: {message}")
        if self.action == "stop":
            warnings.warn(f"GradientMonitor: {message} Stopping training.", stacklevel=3)
            self.model.stop_training = True
        else:
            warnings.warn(f"GradientMonitor: {message}", stacklevel=3)
