"""`GradientMonitor`: alarms on non-finite, vanishing and exploding gradients.

Conventions for steps and layers: see `keras_keepgrad.callbacks`.
"""

import warnings
from collections import deque

import keras
import numpy as np

from keras_keepgrad import _checks
from keras_keepgrad import _replicas
from keras_keepgrad import _stats
from keras_keepgrad.callbacks import _health
from keras_keepgrad.callbacks import _reading
from keras_keepgrad.callbacks import panels

__all__ = ["GradientMonitor"]

_ACTIONS = ("warn", "stop", "raise")
_KIND_NAMES = {"nonfinite": "non-finite", "vanishing": "vanishing", "exploding": "exploding"}
_ENDED = {
    "nonfinite": "gradients are finite again",
    "exploding": "the global norm is back within bounds",
}


def _lasted(since, until, checks):
    plural = "" if checks == 1 else "s"
    return f"steps {since}-{until} ({checks} check{plural})"


class GradientMonitor(keras.callbacks.Callback):
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
      are known), naming the layers with the largest norms.

    By default all three are on: a layer vanishes below `1e-5` and the
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

    Attributes:
        events: List of dicts, one per report of the last `fit`: `kind`
            (`"nonfinite"`, `"vanishing"` or `"exploding"` when a state
            begins; `"nonfinite_ended"`, `"vanishing_ended"` or
            `"exploding_ended"` when it ends), `step` (of the check that
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
        self.events = []
        self.states = []
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
        self._active = {"nonfinite": None, "exploding": None}  # their open states
        self.events = []
        self.states = []
        self._first_step = None
        self._last_step = None

    def _count_layers(self):
        n_layers = len(self._norms.layers)
        self._below = np.zeros(n_layers, np.int64)  # checks in a row below
        self._since = np.zeros(n_layers, np.int64)  # first step of that run
        self._vanishing = [None] * n_layers  # each layer's open state
        self._vanishing_open = np.zeros(n_layers, bool)

    def on_epoch_begin(self, epoch, logs=None):
        self._steps.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._logs = logs if isinstance(logs, dict) else None
        model = _reading.unsynced_model(self)
        previous = self._steps.end_batch(
            batch, self.params, getattr(model, "steps_per_execution", 1)
        )
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
        if self._first_step is None:
            self._first_step = self._step
        self._last_step = self._step
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
            self._recover("nonfinite")
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
        if self._persist("nonfinite"):
            return
        bad = np.flatnonzero(norms.layer_nonfinite)
        self._begin(
            "nonfinite",
            bad,
            self._step,
            f"non-finite gradients (NaN or inf) in {len(bad)} of "
            f"{len(self._norms.layers)} layers, in forward order: "
            f"{self._names(bad)}{_replicas.note(self.model)}.{note}",
        )

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
                state["until"] = self._step
                state["checks"] += 1
                state["_clear"] = 0
            else:
                state["_clear"] += 1
                if state["_clear"] >= self.recovery_steps:
                    ended.append(i)
        new = np.flatnonzero(~is_open & (self._below >= self.vanishing_steps)).tolist()
        for i in ended:
            state, self._vanishing[i] = self._vanishing[i], None
            self._vanishing_open[i] = False
            self._end(
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
            self._recover("exploding")
            return
        if self._persist("exploding"):
            return
        layers = norms.layer_norms
        largest = np.argsort(-np.nan_to_num(layers, nan=-1.0), kind="stable")[:3]
        self._begin(
            "exploding",
            largest,
            self._step,
            f"exploding gradients: global norm {value:.4g} is {reason}; "
            f"largest layer norms: {self._names(largest, layers)}.",
        )

    def _persist(self, kind):
        """Whether a `kind` state is open; if so, this check extends it."""
        state = self._active[kind]
        if state is None:
            return False
        state["until"] = self._step
        state["checks"] += 1
        state["_clear"] = 0
        return True

    def _recover(self, kind):
        """A check free of `kind`: its open state ends after enough of them."""
        state = self._active[kind]
        if state is None:
            return
        state["_clear"] += 1
        if state["_clear"] >= self.recovery_steps:
            self._active[kind] = None
            self._end(state, _ENDED[kind])

    def _begin(self, kind, indices, since, text, per_layer=False):
        """Opens a state (one per layer with `per_layer`) and reports it."""
        layers = [self._norms.layers[i] for i in indices]
        groups = [[layer] for layer in layers] if per_layer else [layers]
        states = []
        for group in groups:
            state = {
                "kind": kind,
                "layers": group,
                "since": since,
                "until": self._step,
                "checks": 1,
                "ongoing": True,
                "_clear": 0,
            }
            self.states.append(state)
            states.append(state)
        if not per_layer:
            self._active[kind] = states[0]
        self._report(kind, layers, text, since=since)
        return states

    def _end(self, state, text):
        state["ongoing"] = False
        since, until, checks = state["since"], state["until"], state["checks"]
        self._report(
            state["kind"] + "_ended",
            state["layers"],
            f"{text} for {self.recovery_steps} checks in a row: the state lasted "
            f"{_lasted(since, until, checks)}.",
            since=since,
            until=until,
            checks=checks,
        )

    def summary(self):
        """The states of the last `fit`, one line each, as a str."""
        if not self.states:
            return "no non-finite, vanishing or exploding gradients"
        lines = []
        for state in self.states:
            names = ", ".join(repr(layer) for layer in state["layers"])
            whole = (
                ", the whole run" if state["ongoing"] and state["since"] == self._first_step else ""
            )
            end = f", until the end{whole}" if state["ongoing"] else ""
            lines.append(
                f"{names} {_KIND_NAMES[state['kind']]}: "
                f"{_lasted(state['since'], state['until'], state['checks'])}{end}"
            )
        return "\n".join(lines)

    def on_train_end(self, logs=None):
        for state in self.states:
            state.pop("_clear", None)
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
        if kind.endswith("_ended"):
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
