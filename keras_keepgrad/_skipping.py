"""Skipping the optimizer update of a bad training step (`skip_bad_steps`).

Backend-neutral. A step is judged where its gradients are kept: at each
optimizer's `apply` (`stateless_apply` on JAX), from the kept gradients
(unscaled, before any optimizer transformation; under a `tf.distribute`
strategy, their sum over the replicas, so that every replica decides
alike). A bad step's update does not run (TensorFlow: each of its writes
guarded, or a `tf.cond` around it; PyTorch: a Python `if`, the step's
bookkeeping runs eagerly there anyway; JAX: a `lax.cond` between the
update and the old values, which a stateful `apply` selects instead), so
the weights and the optimizer's variables, its iteration count included,
stay bit-identical, as a `LossScaleOptimizer` leaves them on a step it
skips. Its gradients are still kept: they are the evidence.

The running state (the recent norms, the epoch's count of skipped steps)
lives in a `keras.metrics.Metric` that the model tracks, so that every
backend carries it as it carries the metrics' state (on JAX, through the
pure step's `metrics_variables`), and `fit` resets the count each epoch as
it resets the metrics. The recent norms are not reset.
"""

import functools
import os

import keras
from keras import ops

from keras_keepgrad import _capture
from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _evidence
from keras_keepgrad import _ops
from keras_keepgrad import _replicas
from keras_keepgrad import _spikes
from keras_keepgrad import _squares
from keras_keepgrad import _torch_compile
from keras_keepgrad import backend

__all__ = ["FLAGGED_LOG_KEY", "LOG_KEY", "SkipBadSteps", "begin", "check_allowed", "config_of"]

# The log key of the count of skipped steps (per epoch, cumulative).
LOG_KEY = "skipped_steps"
# Likewise for the bad steps of `SkipBadSteps(skip=False)`, whose update ran:
# never counted under `LOG_KEY`, which readers take for skipped updates.
FLAGGED_LOG_KEY = "flagged_steps"


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class SkipBadSteps:
    """When a `KeepGradModel` skips a training step's optimizer update.

    Pass it as `KeepGradModel(..., skip_bad_steps=kg.SkipBadSteps(...))`
    (`skip_bad_steps=True` means the defaults: non-finite steps only). A
    step is bad when its kept gradients (what the optimizer's update
    receives: loss scale divided out, before clipping or weight decay)
    hold a NaN or an infinity (`nonfinite=True`), or when their global
    norm exceeds `spike_factor` times the median of the global norms of
    the last `window` steps. The median is only consulted once `window`
    finite norms were seen; every step with a finite norm, skipped or not,
    joins them (so a lasting change of scale is followed, after about
    `window / 2` steps, rather than skipped forever). A step of your own
    that makes several optimizer updates (a GAN's discriminator's, then
    its generator's) declares how many (`updates_per_step`): each update
    is then judged against the norms of the same update in recent steps.

    On a bad step the optimizer's update does not run: the weights and
    the optimizer's variables (moments, iteration count) are left exactly
    as they were. Under a `LossScaleOptimizer`, a non-finite step is
    handed to it as usual, which skips the update itself and halves its
    loss scale (skipping that too would keep the scale too high forever);
    it is counted as skipped all the same. The gradients of a skipped step
    are still kept, in `model.gradients` and the gradient metrics.

    `fit` logs the skipped steps of the epoch so far as `skipped_steps`.

    With `skip=False` bad steps are only flagged: judged, counted and saved
    as above, but their update runs as on any other step. `fit` then logs
    their count as `flagged_steps` (never as `skipped_steps`: their update
    was applied). A `LossScaleOptimizer` still skips non-finite steps
    itself, as it does without `skip_bad_steps`. Use it to collect the
    evidence of rare spikes while training exactly as without it.

    With `save_batches_to`, each bad step also leaves its evidence: the
    batch the training step received (inputs, targets, sample weights),
    its kept gradients, its step number and its loss scale, in one `.npz`
    file per step, `bad_step_<step:08d>.npz` (`..._2.npz`, ... where an
    earlier run left a file of that name), written atomically, whose
    `skipped` entry says whether its update was skipped (False with
    `skip=False`, and True on a skipped step), and whose
    `first_bad_replica` entry names the first replica whose gradients were
    not finite, -1 if none (`model.first_bad_replica`);
    `kg.replay_batch(model, file)` computes its gradients again. Only the
    first `max_saved` files are written (counted in the directory, so a
    later `fit` into it writes no more once it holds them): later bad
    steps are usually the consequences of the first.

    Args:
        nonfinite: Bool. Skip steps whose kept gradients hold a NaN or an
            infinity. Defaults to `True`.
        spike_factor: Float above 1, or None (off). Skip steps whose
            global gradient norm is more than `spike_factor` times the
            median of the last `window` steps' norms. Defaults to None.
        window: Int, at least 1. How many recent norms the median is
            taken over. Defaults to `100`.
        save_batches_to: Str or path of a directory, or None (off): where
            the skipped steps' batches are saved. Defaults to None.
        max_saved: Positive int. How many saved batches the directory
            holds at most. Defaults to `10`.
        skip: Bool. Skip the update of a bad step (True), or only flag
            it (False: counted as `flagged_steps` and saved, its update
            applied). Defaults to `True`.
        updates_per_step: Int, at least 1. How many optimizer updates
            (`apply` calls) the training step makes at most. With a
            `spike_factor`, the k-th update of a step is judged against
            the norms of the k-th updates of the last `window` steps that
            made one (a window each); a step that makes more raises.
            Without one, every update is judged on its own anyway.
            Defaults to `1`.

    Raises:
        TypeError: `nonfinite` or `skip` is not a bool.
        ValueError: `spike_factor` is not a finite number above 1 (or
            None), `window`, `max_saved` or `updates_per_step` is not a
            positive int, nothing is checked (`nonfinite=False` and
            `spike_factor=None`), or `save_batches_to` is not a writable
            directory.
    """

    def __init__(
        self,
        nonfinite: bool = True,
        spike_factor: float | None = None,
        window: int = 100,
        save_batches_to: str | os.PathLike | None = None,
        max_saved: int = 10,
        skip: bool = True,
        updates_per_step: int = 1,
    ) -> None:
        self.nonfinite = _checks.check_bool("nonfinite", nonfinite)
        self.skip = _checks.check_bool("skip", skip)
        self.spike_factor = _checks.check_positive_float("spike_factor", spike_factor, above=1.0)
        self.window = _checks.check_positive_int("window", window)
        self.max_saved = _checks.check_positive_int("max_saved", max_saved)
        self.updates_per_step = _checks.check_positive_int("updates_per_step", updates_per_step)
        if save_batches_to is not None:
            if not isinstance(save_batches_to, (str, os.PathLike)):
                raise TypeError(
                    "`save_batches_to` must be a directory (str or path) or None. "
                    f"Received: save_batches_to={save_batches_to!r} of type "
                    f"{type(save_batches_to).__name__}"
                )
            save_batches_to = os.fspath(save_batches_to)
            _checks.check_writable_dir(save_batches_to, "save_batches_to", save_batches_to)
        self.save_batches_to = save_batches_to
        if not self.nonfinite and self.spike_factor is None:
            raise ValueError(
                "`SkipBadSteps` with `nonfinite=False` and `spike_factor=None` "
                "checks nothing. Set `spike_factor` (e.g. 10.0), keep "
                "`nonfinite=True`, or pass `skip_bad_steps=None` to turn "
                "skipping off."
            )

    def get_config(self):
        config = {
            "nonfinite": self.nonfinite,
            "spike_factor": self.spike_factor,
            "window": self.window,
        }
        if self.save_batches_to is not None:
            config.update(save_batches_to=self.save_batches_to, max_saved=self.max_saved)
        # Each only when set: the configs saved before they existed stay equal.
        if not self.skip:
            config["skip"] = False
        if self.updates_per_step != 1:
            config["updates_per_step"] = self.updates_per_step
        return config

    @property
    def log_key(self):
        """Str. The log key of the epoch's count of bad steps."""
        return LOG_KEY if self.skip else FLAGGED_LOG_KEY

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return isinstance(other, SkipBadSteps) and self.get_config() == other.get_config()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"SkipBadSteps({args})"


def config_of(value):
    """The `SkipBadSteps` that `skip_bad_steps=value` means, or None (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return SkipBadSteps()
    if isinstance(value, SkipBadSteps):
        return value
    if isinstance(value, dict):
        # As `get_config()` saved it.
        return SkipBadSteps.from_config(value)
    raise TypeError(
        "`skip_bad_steps` must be None or False (off), True (skip non-finite "
        "steps) or a `keras_keepgrad.SkipBadSteps(...)`. Received: "
        f"skip_bad_steps={value!r} of type {type(value).__name__}"
    )


class SkippedSteps(keras.metrics.Metric):
    """The state of `skip_bad_steps`: the epoch's count, the recent norms.

    Logged as `skipped_steps` in training only (absent from `evaluate()`
    and the `val_` logs). `reset_state` (each epoch) resets the count, not
    the recent norms: `norms`, oldest first, `_spikes.EMPTY` where none
    was recorded yet; with several `updates` per step, a window each
    (`[updates, window]`; one update: `[window]`).
    """

    def __init__(self, window, counts_steps=False, name=LOG_KEY, updates=1):
        super().__init__(name=name, dtype="float32")
        self.window = window
        self.counts_steps = counts_steps
        self.updates = updates
        self.skipped = self._state((), "skipped")
        # Training steps since the last reset: nothing is logged before one.
        self.steps = self._state((), "steps")
        each = () if updates == 1 else (updates,)
        empty = keras.initializers.Constant(_spikes.EMPTY)
        self.norms = self._state((*each, window), "norms", empty)
        self.names = ("skipped", "steps", "norms")
        if counts_steps:
            # Where batches are saved: the step number, never reset.
            self.total = self._state((), "total")
            self.names += ("total",)

    def _state(self, shape, name, initializer="zeros"):
        # Under a `tf.distribute` strategy every replica judges the global
        # gradients and holds the same state: read once, not summed.
        return self.add_variable(
            shape=shape, initializer=initializer, aggregation="only_first_replica", name=name
        )

    def state_variables(self):
        return [getattr(self, n) for n in self.names]

    def reset_state(self):
        self.skipped.assign(0.0)
        self.steps.assign(0.0)

    def update_state(self, *args, **kwargs):
        """Updated by the training step itself (`Guard.finish`)."""

    def result(self):
        if _capture.in_evaluation_step() or _compat.in_symbolic_build():
            return {}
        if _capture.current_step() is None and float(ops.convert_to_numpy(self.steps)) == 0.0:
            return {}
        # A copy: Keras's PyTorch trainer holds the epoch's results through
        # validation, which resets the variables in place.
        return {self.name: ops.copy(ops.convert_to_tensor(self.skipped))}

    result = _torch_compile.eager(result)

    def get_config(self):
        config = {"name": self.name, "window": self.window}
        if self.updates != 1:
            config["updates"] = self.updates
        return config


def check_allowed(model):
    """Raises, before training, if `model` cannot skip bad steps as set up."""
    if not model.keep_gradients:
        raise ValueError(
            f"Model {model.name!r} skips bad steps (`skip_bad_steps`), which "
            "judges each step by its kept gradients, but keeps no gradients "
            "(`keep_gradients=False`). Set `model.keep_gradients = True`, or "
            "`model.skip_bad_steps = None`."
        )
    refused = model._strategy_refuses_skipping()
    if refused is not None:
        raise ValueError(refused)


@_torch_compile.eager
def begin(model, args):
    """The `Guard` of `model`'s training step being opened, or None.

    None where the model does not skip, or in a step that another of its
    steps calls (the outer one judges).
    """
    step = _capture.current_step()
    config = model._skip_config
    if config is None or step is None or step.model is not model or step.guard is not None:
        return None
    metric = model._skipped_metric
    values = model._skip_state_in(args, metric.state_variables())
    data = None
    if config.save_batches_to is not None:
        data = _evidence.flatten_batch(model._step_data(args))
    step.guard = Guard(model, config, dict(zip(metric.names, values)), data, args)
    return step.guard


class Guard:
    """Judges one training step's updates; holds its skipping state.

    Args:
        model: The model whose step it is.
        config: Its `SkipBadSteps`.
        state: `{name: tensor}` of the `SkippedSteps` variables as the
            step begins.
        data: `{key: tensor}` of the step's batch (`_evidence.flatten_batch`)
            where skipped steps' batches are saved, else None.
        args: The step's arguments, for `model._bad_devices` where the
            batch is saved.
    """

    def __init__(self, model, config, state, data=None, args=None):
        self.model = model
        self.config = config
        self.state = state
        self.data = data
        self.args = args  # the step's arguments
        self.finite = None  # whether all its judged gradients were finite
        # Whether a `LossScaleOptimizer` skipped an update (non-finite) itself.
        self.scale_skipped = None
        self.judged = 0
        self.scale = None  # a `LossScaleOptimizer`'s scale as the step ran
        # `{key: kept gradient}` judged, where batches are saved: "grad/<path>",
        # or "grad/<k>/<path>" for the k-th of several updates a step.
        self.kept = {}
        self.bads = []  # whether each update of the step was bad

    def _judge(self, optimizer, kept, scale=None, called="`apply` or `apply_gradients`"):
        """Whether to run the update of `kept` (of the methods `called`
        names); records the step's badness."""
        config = self.config
        self.judged += 1
        most = config.updates_per_step
        if config.spike_factor is not None and self.judged > most:
            # The first `apply`s ran already where the step runs as called.
            _capture.current_step().put_back()
            times = "once" if most == 1 else f"{most} times"
            raise ValueError(
                f"The training step of model {self.model.name!r} called an "
                f"optimizer's {called} more than {times}, and `skip_bad_steps` "
                "with a `spike_factor` compares the global gradient norm of "
                "each update of a step with those of the same update in "
                f"recent steps: it has windows for {most} "
                f"(`updates_per_step={most}`). Pass `SkipBadSteps(..., "
                f"updates_per_step=N)` with N the number of {called} calls "
                "of one step, apply all gradients in one call, or use "
                "`spike_factor=None` (each update is then skipped on "
                "non-finite gradients of its own)."
            )
        grads = [ops.cast(backend.densify(g), "float32") for g in kept]
        by_index = dict(enumerate(grads))
        finite = ops.convert_to_tensor(True)
        if grads and config.spike_factor is None and self._compiled_by_tf_xla():
            # No norm is read: XLA fuses a look at every entry into one
            # pass, where TensorFlow's branch would be a conditional that
            # the update's fusions wait on whole (measured 4.4 points of a
            # step more on a 1M-parameter MLP). JAX's jitted step keeps the
            # branch: there looking at every entry measured about 3 points
            # more than the spike rule's sums and branch in the same run.
            finite = _squares.entries_finite(grads)
        elif grads:
            # One pass serves the check and the norm: a finite sum has only
            # finite terms; a non-finite one holds NaN or inf, or overflowed
            # float32 (a norm above ~1.8e19), and only then is every entry
            # looked at. (Under XLA with the spike rule, looking at every
            # entry besides the sums measured 5.1 points of a step beyond
            # the floor in one run, the branch +0.5 and +1.2 in two pools
            # of three; without XLA it is no cheaper than the branch; on
            # PyTorch it is two more kernels a gradient.)
            finite = _ops.cond(
                _squares.shared_finite(by_index),
                lambda: ops.convert_to_tensor(True),
                lambda: _squares.entries_finite(grads),
            )
        bad = ops.logical_not(finite) if config.nonfinite else ops.convert_to_tensor(False)
        a = _spikes.TENSORS
        if config.spike_factor is not None:
            a = _spikes.arithmetic()
            # Each gradient's sum of squares (the norm), shared with the
            # step's statistics and gradient metrics where they asked, and
            # with the finite judgement above.
            squares = _squares.shared_squares(by_index)
            # With several updates a step, the k-th's own window.
            row = None if most == 1 else self.judged - 1
            spiked, self.state["norms"] = _spikes.spike(
                a, squares, finite, self.state["norms"], config.spike_factor, config.window, row
            )
            bad = a.logical_or(bad, spiked)
        self.bads.append(bad)
        self.finite = finite if self.finite is None else ops.logical_and(self.finite, finite)
        if scale is not None and self.scale is None:
            self.scale = scale
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            lowered = ops.logical_not(finite)
            previous = self.scale_skipped
            self.scale_skipped = lowered if previous is None else ops.logical_or(previous, lowered)
            # It skips non-finite updates itself, and lowers its scale.
            return ops.logical_or(ops.logical_not(bad), ops.logical_not(finite))
        if config.spike_factor is None:
            # `bad` is `not finite` (`nonfinite` is then set): one op less
            # before the update.
            return finite
        return a.logical_not(bad)

    def _compiled_by_tf_xla(self):
        """Whether XLA compiles the TensorFlow step being traced
        (`jit_compile=True`)."""
        model = self.model
        return _compat.BACKEND == "tensorflow" and model.jit_compile and not model.run_eagerly

    def apply(self, optimizer, variables, kept, grads, apply):
        """Runs `apply()` (a stateful `apply` of `grads`) unless the update
        is bad."""
        # Under a strategy, each replica judges the global gradients: all
        # replicas take the same decision, on what one device would see.
        kept = backend.global_gradients(_capture.current_step(), kept, grads)
        self._hold(variables, kept)
        scale = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            _capture.build_as_apply(optimizer, variables)  # its scale is made there
            # Read before the update, which halves it on a non-finite step.
            scale = ops.copy(ops.convert_to_tensor(optimizer.dynamic_scale))
        run = self._judge(optimizer, kept, scale)
        if not self.config.skip:
            return apply()  # flagged only: the update runs as without a guard
        return backend.apply_if(run, apply, optimizer, variables, grads)

    def apply_stateless(self, optimizer, kept, apply, unchanged):
        """`apply()` (a `stateless_apply`), or `unchanged` if the update is bad."""
        self._hold(_compat.optimizer_variables(optimizer), kept)
        scale = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            # The step's value of it, among the optimizer's as passed.
            index = [id(v) for v in optimizer.variables].index(id(optimizer.dynamic_scale))
            scale = unchanged[1][index]
        run = self._judge(optimizer, kept, scale, "`stateless_apply`")
        if not self.config.skip:
            return apply()
        # A branch, as `LossScaleOptimizer.stateless_apply` has: selecting
        # between the new and the old values would read both, every step.
        return ops.cond(run, apply, lambda: unchanged)

    @_torch_compile.eager
    def finish(self, result):
        """The step's result, with its skipping state and `skipped_steps`."""
        state = self.state
        # On PyTorch in Python floats, as the spike rule (`_spikes`): the
        # counts are whole numbers, exact in float32 and float64 alike.
        a = _spikes.arithmetic()
        # Whether an update of the step was bad.
        bads = self.bads or [ops.convert_to_tensor(False)]
        bad = functools.reduce(ops.logical_or, bads)
        state["skipped"] = a.add(a.read(state["skipped"]), a.count(bad))
        state["steps"] = a.add(a.read(state["steps"]), 1.0)
        metric = self.model._skipped_metric
        # The recent norms change only where spikes are checked: no write else.
        names = metric.names if self.config.spike_factor is not None else ("skipped", "steps")
        if self.data is not None:
            state["total"] = a.add(a.read(state["total"]), 1.0)
            if "total" not in names:
                names = (*names, "total")
            self._save_if(bad)
        pairs = [(getattr(metric, n), state[n]) for n in names]
        return self.model._skip_state_out(result, pairs, {self.config.log_key: state["skipped"]})

    def _hold(self, variables, kept):
        """Holds the kept gradients judged, for `_save_if`: as judged, not
        as the step's record, which may hold them as the update reduced
        them (inside its `tf.cond`)."""
        if self.data is not None:
            # Each update's own where there are several: on JAX each is
            # handed every variable, and a later one would hide an earlier.
            several = self.config.updates_per_step > 1
            prefix = f"grad/{self.judged}/" if several else "grad/"
            for variable, grad in zip(variables, kept):
                self.kept[prefix + variable.path] = grad

    def _save_if(self, bad):
        """Saves the step's evidence on the host where it was skipped."""
        tensors = dict(self.data)
        tensors["step"] = ops.convert_to_tensor(self.state["total"], "float32")
        for key, grad in self.kept.items():
            tensors[key] = ops.cast(backend.densify(grad), "float32")
        most = self.config.updates_per_step
        if most > 1:
            # Which of them was bad; an update the step did not make, not.
            bads = [*self.bads, *[False] * (most - len(self.bads))]
            tensors["bad_updates"] = ops.stack([ops.convert_to_tensor(b) for b in bads])
        if self.scale is not None:
            tensors["loss_scale"] = ops.cast(self.scale, "float32")
        config = self.config
        # Whether the update ran: a flagged step's did, unless a
        # `LossScaleOptimizer` skipped it itself.
        skipped = bad if config.skip else self.scale_skipped
        tensors["skipped"] = ops.convert_to_tensor(False) if skipped is None else skipped
        first = _replicas.one_replica_first_bad(self.model, self.finite)
        if first is None and self.finite is not None:
            # Devices whose partial gradients never exist apart: replayed.
            first = _replicas.first_of(self.model._bad_devices(self.args, self.finite))
        if first is not None:
            tensors["first_bad_replica"] = first
        save = functools.partial(_evidence.save, config.save_batches_to, config.max_saved)
        backend.call_if(bad, save, tensors, rows=tuple(self.data))
