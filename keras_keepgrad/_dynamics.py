"""Training-dynamics metrics: gradient noise scale, gradient SNR, step cosine.

Each compares gradients of several batches at once, which a single kept
gradient cannot give: where a `tf.distribute` strategy trains several
replicas in this process, every replica's partial gradient is one small
batch and the global gradient their mean; otherwise (one device, worker
processes, where the step all-reduces before anything is kept, and on JAX
and PyTorch, `keras.distribution` included) the last `accumulation_steps`
steps' gradients are the small batches, summed in one float32 buffer per
trainable variable.

The small-batch gradients and their batch sizes, in Keras's terms. Keras
scales each replica's loss by `1 / R` (R replicas), so that the replicas'
gradients sum to the global-batch mean gradient: replica r's partial
gradient `p_r` is `g_r / R`, where `g_r` is the mean gradient of its own
`b_r` examples, and the global gradient is `G_big = sum_r p_r = mean_r g_r`.
On one device the step's gradient `g_i` is the mean over its `b_i` examples
and `G_big = mean_i g_i` over the window of k steps. Either way, with n
small batches, their mean squared norm `S = mean_i |g_i|^2` and
`Q = |G_big|^2`, if the small batches are independent draws at the same
weights, `E[S] = |G|^2 + tr(Sigma) / B_small` and
`E[Q] = |G|^2 + tr(Sigma) / B_big`, with `B_small = 1 / mean_i(1 / b_i)` and
`B_big = n * B_small` (equal batches: `B_small = b`, `B_big = n b`).

The arithmetic is written once: on JAX and PyTorch `tf` is `_ops.tf_ops`,
the same functions in `keras.ops`, as in `metrics.py`. The state differs:
on TensorFlow it is plain `tf.Variable`s, one local copy per replica, kept
out of Keras's tracking (`_Holder`); on JAX and PyTorch it is the metric's
own Keras variables (`add_variable`), which the JAX step threads through
as metrics variables, so they are made before the step is traced
(`_build_for`). Keras saves no metric's variables in its files, and
`reset_state` (`GradientMetric`'s) resets only the epoch's sums: the
window, the previous gradient and the moving averages persist.
"""

import math
import numbers
from typing import Any

import keras

from keras_keepgrad import _capture
from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad.metrics import GradientMetric
from keras_keepgrad.metrics import _float32
from keras_keepgrad.metrics import _group_by_layer
from keras_keepgrad.metrics import _Holder
from keras_keepgrad.metrics import _PerLayerMixin
from keras_keepgrad.metrics import _sum_of_squares

if _compat.BACKEND == "tensorflow":
    import tensorflow as tf

    from keras_keepgrad._stats import shared_squares as _shared_squares
    from keras_keepgrad.backend.tensorflow import keeper as _keeper
else:
    from keras_keepgrad._ops import shared_squares as _shared_squares
    from keras_keepgrad._ops import tf_ops as tf

__all__ = [
    "GradientCosine",
    "GradientNoiseScale",
    "GradientSNR",
    "tensorboard_charts",
]

_TENSORFLOW = _compat.BACKEND == "tensorflow"


def _local_variable(value, dtype=None):
    # One copy per replica, updated by that replica alone: every replica
    # computes the same values (from all-reduced statistics), so no copy
    # needs the others'. Out of Keras's tracking: see `_Holder`.
    return tf.Variable(
        tf.cast(value, dtype or tf.float32),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _create(fn):
    """Runs `fn` (which makes variables) outside the function being traced.

    In a replica's step of a `tf.distribute` strategy, variables are made
    once for all replicas, in its cross-replica context.
    """

    def create(strategy=None):
        with tf.init_scope():
            if strategy is None:
                return fn()
            with strategy.scope():
                return fn()

    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None:
        return context.merge_call(create)
    return create()


def _read(variable):
    return tf.convert_to_tensor(variable)


def _assign(variable, value):
    if _TENSORFLOW:
        variable.assign(value, read_value=False)
    else:
        variable.assign(value)


def _assign_add(variable, value):
    if _TENSORFLOW:
        variable.assign_add(value, read_value=False)
    elif _compat.BACKEND == "torch":
        # One pass over the window's buffer, not Keras's two.
        _compat.torch_assign_add(variable, value)
    else:
        variable.assign_add(value)


def _replica_context():
    """The replica context if this step's kept gradients are partial ones."""
    if not _TENSORFLOW:
        return None
    step = _capture.current_step()
    context = tf.distribute.get_replica_context()
    if step is None or step.reduced or context is None or context.num_replicas_in_sync < 2:
        return None
    return context


def _replicas_in_process():
    """Whether a step keeps each replica's partial gradient (TensorFlow's
    strategies only: under `keras.distribution` on JAX the step computes the
    global batch's gradient at once)."""
    if not _TENSORFLOW:
        return False
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync > 1 and not _keeper.reduces_in_step(strategy)


def _batch_size(y_true, y_pred):
    """The number of examples in this replica's batch, as float32."""
    for structure in (y_pred, y_true):
        for t in keras.tree.flatten(structure):
            if t is not None and getattr(t, "shape", None) is not None and len(t.shape) > 0:
                return tf.cast(keras.ops.shape(t)[0], tf.float32)
    return None


def _group_squares(grads, groups):
    """float32 `[groups]`: each group's sum of squared gradient entries.

    From the step's per-variable sums (`shared_squares`), which the norm
    metrics and the callbacks' statistics of the same step share: a
    statistic that needs them adds no pass over the gradients of its own
    where one of those asked for them too.
    """
    squares = _shared_squares(grads)
    if len(groups) == 1:
        return tf.cast(tf.reduce_sum(squares), tf.float32)[None]
    position = {p: i for i, p in enumerate(grads)}
    segment = [0] * len(position)
    for g, paths in enumerate(groups.values()):
        for p in paths:
            segment[position[p]] = g
    summed = tf.math.unsorted_segment_sum(squares, tf.constant(segment), len(groups))
    return tf.cast(summed, tf.float32)


def _after_optimizer_updates():
    """Control inputs that wait for the step's optimizer updates.

    Those wait in turn for the writes of the kept gradients (`_keeper.after`).
    A buffer that took a previous step's gradient by assignment shares its
    memory with that step's slot until the slot takes this step's gradient;
    updating the buffer in place only after that avoids a copy.
    """
    variables = _keeper.current_step_variables() or {}
    return [tf.convert_to_tensor(v.value) for v in variables.values()]


def _add_to_window(sums, dense, first):
    """Adds this step's gradients to the window's sums; `first` (a bool
    tensor) starts a new window with them."""
    paths = list(dense)

    def start():
        # A window's first gradient is assigned: on TensorFlow the buffer
        # shares its memory (without XLA), where zeroing it would write it.
        for p in paths:
            _assign(sums[p], dense[p])
        return tf.constant(True)

    def accumulate():
        for p in paths:
            _assign_add(sums[p], dense[p])
        return tf.constant(False)

    if _compat.BACKEND == "jax":
        # The step is a pure function (also run eagerly): no branch on a
        # traced value, and an assignment is a new value anyway.
        for p in paths:
            _assign(sums[p], keras.ops.where(first, dense[p], _read(sums[p]) + dense[p]))
    elif tf.executing_eagerly():
        # PyTorch's step, and TensorFlow's with `run_eagerly=True`.
        (start if bool(first) else accumulate)()
    else:
        with tf.control_dependencies(_after_optimizer_updates()):
            tf.cond(first, start, accumulate)


def _check_steps(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 2:
        return int(value)
    raise ValueError(
        f"`{name}` must be an int of at least 2 (the steps whose gradients "
        f"are compared). Received: {name}={value!r}"
    )


class _DynamicsMetric(GradientMetric):
    """Reports NaN for an epoch in which no step gave a value.

    A step that gives none (`counted` False) adds 0, not its placeholder
    value (NaN where nothing is known yet), to the sums of `"mean"`.
    """

    def __init__(self, **kwargs):
        super().__init__(fn=None, **kwargs)
        self._counted = self.add_variable(
            shape=(), initializer="zeros", aggregation="mean", name="counted"
        )
        self._holder = _Holder()

    def _zeros(self, shapes, name):
        """New float32 variables of zeros, one per shape: the metric's state.

        On TensorFlow plain local variables (`_local_variable`), made
        outside the step being traced; on JAX and PyTorch the metric's own
        variables, which JAX's step must find among the metrics variables
        it was given: made before it is traced.
        """
        if _TENSORFLOW:
            return _create(lambda: [_local_variable(tf.zeros(s)) for s in shapes])
        if _compat.BACKEND == "jax" and _capture.current_step() is not None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} needs state for the "
                "variables whose gradients this step keeps, which on JAX must "
                "be made before the training step is traced, from the "
                "model's trainable variables. Received: a step that keeps "
                "other variables than those it was made for, or a metric "
                "that is not compiled into the model. Compile it into the "
                "model (`compile(metrics=[...])`) and pass every trainable "
                "variable's gradient to an optimizer."
            )
        return [
            self.add_variable(
                shape=tuple(s), initializer="zeros", aggregation="only_first_replica", name=name
            )
            for s in shapes
        ]

    def _drop(self, variables):
        """Stops tracking variables of a state that was made anew."""
        if not _TENSORFLOW and variables:
            _compat.untrack_metric_variables(self, variables)

    def _parameter_state(self, paths, shapes, counters):
        """The metric's buffers, made for these variable paths and shapes.

        `{"buffers": {path: float32 variable of its shape}, "counters":
        float32 variable [groups + counters]}`, remade when the paths or
        shapes change.
        """
        state = self._holder.variables
        made_for = dict(zip(tuple(paths), (tuple(s) for s in shapes)))
        if state.get("paths") != made_for:
            size = len(self._groups(list(made_for))) + counters
            old = [*state.get("buffers", {}).values()]
            old += [state["counters"]] if "counters" in state else []
            *buffers, counter = self._zeros([*made_for.values(), (size,)], "window")
            self._drop(old)
            state.update(buffers=dict(zip(made_for, buffers)), counters=counter, paths=made_for)
        return state

    def _measure(self, grads):
        values, counted = self._counted_values(grads)
        return {k: tf.where(counted, v, 0.0) for k, v in values.items()}, counted

    def result(self):
        results = super().result()
        if not results:
            return results
        none = tf.equal(tf.convert_to_tensor(self._counted), 0.0)
        return {k: tf.where(none, tf.constant(math.nan), v) for k, v in results.items()}


class _SmallBatches(_DynamicsMetric):
    """Per group of variables, the statistics of the step's small batches.

    `_moments` gives, per group (one for all variables, or one per layer),
    `S` (the mean over the n small batches of their gradients' squared
    norm) and `Q` (the squared norm of their mean), with `mean(1 / b_i)`,
    n, and whether a window is complete (always, across replicas).
    """

    def __init__(self, accumulation_steps, **kwargs):
        self.accumulation_steps = _check_steps("accumulation_steps", accumulation_steps)
        self._y = (None, None)
        super().__init__(**kwargs)

    def _groups(self, paths):
        """`{log key: [path, ...]}`."""
        if getattr(self, "per_layer", False):
            groups = _group_by_layer({p: p for p in paths})
            return {f"{self.name}/{layer}": ps for layer, ps in groups.items()}
        return {self.name: list(paths)}

    def update_state(self, y_true=None, y_pred=None, sample_weight=None):
        """Adds this training step's value; does nothing in evaluation.

        `y_true` and `y_pred` give the batch size (their first axis);
        `sample_weight` is ignored.
        """
        self._y = (y_true, y_pred)
        try:
            super().update_state(y_true, y_pred, sample_weight)
        finally:
            self._y = (None, None)

    def _step_batch_size(self):
        batch = _batch_size(*self._y)
        if batch is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} takes the batch size from "
                "the first axis of `y_pred` (or `y_true`). Received: "
                f"y_true={self._y[0]!r}, y_pred={self._y[1]!r}. In your own "
                "`train_step`, call `self.compute_metrics(x, y, y_pred)` or "
                "`metric.update_state(y, y_pred)`."
            )
        return batch

    # State --------------------------------------------------------------

    def _build_for(self, variables):
        super()._build_for(variables)
        if not _replicas_in_process():
            self._window_state([v.path for v in variables], [v.shape for v in variables])

    def _window_state(self, paths, shapes):
        """The accumulation window: the sum of its gradients per variable,
        and over the window so far, per group the sum of |g_i|^2, then the
        sum of 1 / b_i, then the number of steps."""
        return self._parameter_state(paths, shapes, counters=2)

    # One step -----------------------------------------------------------

    def _moments(self, grads):
        """`(S, Q, mean_inverse_batch, n, ready)`; S and Q are `[groups]`."""
        groups = self._groups(grads)
        context = _replica_context()
        if context is not None:
            return self._across_replicas(context, groups)
        return self._over_window(grads, groups)

    def _across_replicas(self, context, groups):
        replicas = float(context.num_replicas_in_sync)
        partial = _capture.current_step().grads
        # |g_r|^2 = |R p_r|^2; the global gradient is the all-reduced one.
        local = [
            replicas**2 * _sum_of_squares([_float32(partial[p]) for p in paths])
            for paths in groups.values()
        ]
        batch = self._step_batch_size() if self._needs_batch_size else tf.constant(1.0)
        vector = tf.stack([*local, 1.0 / tf.maximum(batch, 1.0), tf.cast(batch < 1.0, tf.float32)])
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, vector)
        n_groups = len(groups)
        # The global gradient's squares, shared with the norm metrics.
        big = _group_squares(_keeper.current_step_gradients(), groups)
        small = summed[:n_groups] / replicas
        inverse = summed[n_groups] / replicas
        ready = tf.equal(summed[n_groups + 1], 0.0)
        return small, big, inverse, tf.constant(replicas), ready

    def _over_window(self, grads, groups):
        paths = list(grads)
        dense = {p: _float32(grads[p]) for p in paths}
        state = self._window_state(paths, [dense[p].shape for p in paths])
        k = float(self.accumulation_steps)
        n_groups = len(groups)
        batch = self._step_batch_size() if self._needs_batch_size else tf.constant(1.0)
        this_step = tf.concat(
            [
                _group_squares(grads, groups),
                tf.stack([1.0 / tf.maximum(batch, 1.0), tf.constant(1.0)]),
            ],
            0,
        )
        before = _read(state["counters"])
        totals = before + this_step
        ready = tf.equal(totals[-1], k)
        sums = state["buffers"]
        _add_to_window(sums, dense, tf.equal(before[-1], 0.0))

        def complete():
            # |mean g_i|^2 of the window, once per window.
            big = [_sum_of_squares([_read(sums[p]) for p in ps]) for ps in groups.values()]
            return tf.stack(big) / (k * k)

        big = tf.cond(ready, complete, lambda: tf.zeros((n_groups,)))
        _assign(state["counters"], totals * (1.0 - tf.cast(ready, tf.float32)))
        return totals[:n_groups] / k, big, totals[n_groups] / k, tf.constant(k), ready

    _needs_batch_size = True

    def get_config(self):
        config = super().get_config()
        config["accumulation_steps"] = self.accumulation_steps
        return config


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientNoiseScale(_SmallBatches):
    """The simple gradient noise scale `B_simple = tr(Sigma) / |G|^2`.

    Logged as `grad_noise_scale`. `G` is the true (expected) gradient and
    `Sigma` the covariance of the per-example gradients, at the current
    weights. McCandlish et al. (2018), "An Empirical Model of Large-Batch
    Training", show that `B_simple` predicts the critical batch size:
    batches much smaller than it are dominated by noise (doubling the batch
    nearly halves the steps needed), batches much larger waste examples
    (doubling the batch barely saves steps).

    The estimate uses no per-example gradients. From two batch sizes
    `B_small < B_big`, whose gradients' squared norms are `S` and `Q`, it
    takes the unbiased estimators of the paper's Appendix A.1:

        |G|^2     ~ (B_big Q - B_small S) / (B_big - B_small)
        tr(Sigma) ~ (S - Q) / (1 / B_small - 1 / B_big)

    Each is smoothed by an exponential moving average over the estimates
    (with weight `smoothing` on the past, debiased as in Adam) before their
    ratio is taken: a single step's estimate of `|G|^2` is noisy and can be
    negative.

    Where the small and big batches come from:

    - Under a `tf.distribute` strategy whose replicas all run in this
      process (`MirroredStrategy`): each replica's batch is a small batch
      and the global batch the big one, at no extra backward pass. Keras
      scales a replica's loss by `1 / R`, so a replica's gradient of its own
      batch is R times its partial gradient; `S` is their mean squared norm
      over the replicas, `Q` the squared norm of the global gradient,
      `B_small` the per-replica batch and `B_big = R B_small`. Needs 2 or
      more replicas; one scalar per replica is all-reduced per step.
    - Otherwise (one device, worker processes, and on JAX and PyTorch,
      `keras.distribution.DataParallel` included): the big batch is the mean
      of `accumulation_steps` = k consecutive steps' gradients, each step a
      small batch (`B_big = k B_small`), summed in one float32 buffer the
      size of the trainable variables. An estimate comes every k steps. The
      weights move during the k steps, which biases the estimate upward:
      with `V` the spread of the true gradient over the window (the mean of
      `|G_i - mean(G_i)|^2` over its steps), `|G|^2` comes out `V / (k - 1)`
      too small and `tr(Sigma)` `V k B_small / (k - 1)` too large. It
      vanishes with the learning rate and is small while the gradient
      changes little over k steps; a smaller k lowers it, at more noise.

    The batch size is read from the first axis of `y_pred`; a smaller last
    batch is accounted for (the sizes combine as `1 / mean(1 / b)`). The
    loss must be a mean over the batch (Keras's default reduction,
    `"sum_over_batch_size"`).

    The estimate persists across epochs (it is not reset at an epoch's
    start): the logged value is the current smoothed estimate, NaN in an
    epoch before the first estimate is complete.

    Runs on TensorFlow, JAX and PyTorch, with the same numbers. Its state
    is never in `model.weights` or saved files; on JAX it is made when
    `fit` builds the training function, so the metric must be compiled
    into the model.

    Args:
        accumulation_steps: Int, at least 2. Steps whose gradients form the
            big batch where replicas cannot. Defaults to `4`.
        smoothing: Float in [0, 1). The moving average's weight on the
            previous estimates; 0 uses each estimate alone. Defaults to
            `0.9`.
        components: Bool. Also log the smoothed `tr(Sigma)` as
            `grad_noise_scale/trace_cov` and `|G|^2` as
            `grad_noise_scale/grad_sq` (with `name` in place of
            `grad_noise_scale`). Defaults to `False`.
        name: String. Log key. Defaults to `"grad_noise_scale"`.
        reduction: String. `"last"`, `"mean"`, `"sum"` or `"max"`, as for
            `GradientMetric`, of the current estimate over the epoch's
            steps that have one (from the first complete estimate on).
            Defaults to `"last"`.
        **kwargs: Passed on to `GradientMetric`.

    Raises:
        ValueError: `accumulation_steps` is not an int of at least 2, or
            `smoothing` is not in [0, 1).

    Examples:
        ```python
        model.compile(optimizer="sgd", loss="mse",
                      metrics=[kg.metrics.GradientNoiseScale()])
        history = model.fit(x, y, batch_size=32, epochs=5)
        history.history["grad_noise_scale"]  # B_simple, in examples
        ```
    """

    _default_name = "grad_noise_scale"

    def __init__(
        self,
        accumulation_steps: int = 4,
        smoothing: float = 0.9,
        components: bool = False,
        name: str = "grad_noise_scale",
        reduction: str = "last",
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(smoothing, bool)
            or not isinstance(smoothing, numbers.Real)
            or not 0.0 <= smoothing < 1.0
        ):
            raise ValueError(
                "`smoothing` must be a number in [0, 1) (the moving average's "
                f"weight on the past). Received: smoothing={smoothing!r}"
            )
        self.smoothing = float(smoothing)
        self.components = _checks.check_bool("components", components)
        super().__init__(
            accumulation_steps=accumulation_steps, name=name, reduction=reduction, **kwargs
        )

    def _keys_for(self, paths):
        if self.components:
            return (self.name, f"{self.name}/trace_cov", f"{self.name}/grad_sq")
        return (self.name,)

    def _averages(self):
        state = self._holder.variables
        if "average" not in state:
            # Moving averages of |G|^2 and tr(Sigma), and 1 - smoothing^m
            # after m estimates (the debiasing factor).
            (state["average"],) = self._zeros([(3,)], "average")
        return state["average"]

    def _build_for(self, variables):
        super()._build_for(variables)
        self._averages()

    def _counted_values(self, grads):
        small, big, inverse, n, ready = self._moments(grads)
        small, big = small[0], big[0]
        # |G|^2 ~ (B_big Q - B_small S) / (B_big - B_small) and
        # tr(Sigma) ~ (S - Q) / (1/B_small - 1/B_big), with
        # B_small = 1 / inverse and B_big = n / inverse.
        grad_sq = (n * big - small) / (n - 1.0)
        trace = n * (small - big) / ((n - 1.0) * inverse)
        average = self._averages()
        beta = self.smoothing
        previous = _read(average)
        new = beta * previous + (1.0 - beta) * tf.stack([grad_sq, trace, tf.constant(1.0)])
        new = tf.where(ready, new, previous)
        _assign(average, new)
        grad_sq, trace = new[0] / new[2], new[1] / new[2]
        values = {self.name: trace / grad_sq}
        if self.components:
            values[f"{self.name}/trace_cov"] = trace
            values[f"{self.name}/grad_sq"] = grad_sq
        return values, new[2] > 0.0

    def get_config(self):
        config = super().get_config()
        config["smoothing"] = self.smoothing
        config["components"] = self.components
        return config


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientSNR(_PerLayerMixin, _SmallBatches):
    """The gradient's signal-to-noise ratio, per layer: `grad_snr/<layer>`.

    Over n small-batch gradients `g_1 ... g_n` of a layer's variables (its
    kernel and bias as one vector), the mean `m = mean_i g_i` is the signal
    and the entries' sample standard deviations across the small batches
    the noise, pooled over the layer's entries:

        SNR = |m| / sqrt(sum_j var_j),
        var_j = sum_i (g_ij - m_j)^2 / (n - 1)

    so the SNR is the norm of the mean gradient over the norm of its
    standard deviations. For small batches of b examples `E[sum_j var_j] =
    tr(Sigma) / b` and `E|m|^2 = |G|^2 + tr(Sigma) / (n b)`, so `SNR^2` is
    about `b / B_simple + 1 / n`, restricted to the layer
    (`GradientNoiseScale`): pure noise reads about `1 / sqrt(n)` (0.71 for
    2 small batches, 0.5 for 4), not 0. Well above 1 the batch gradient's
    direction is mostly signal; near `1 / sqrt(n)` it is mostly noise, and
    a larger batch (or a smaller learning rate) helps that layer. Pooled
    rather than averaged per entry: an entry that no example reaches has
    zero variance, and one ratio per entry would be undefined there.

    The small batches are the replicas' batches under a `tf.distribute`
    strategy with 2 or more replicas in this process (each replica's
    gradient is R times its partial one, and `m` is the global gradient),
    otherwise (one device, and on JAX and PyTorch, `keras.distribution`
    included) the last `accumulation_steps` steps, used as micro-batches
    (one value every k steps; the weights move between them, which adds
    their drift to the noise). It is `inf` where the small batches agree
    exactly, NaN for a layer with zero gradients. Needs no batch size.
    Runs on TensorFlow, JAX and PyTorch.
    With `reduction="mean"`, an epoch in which no window completes (fewer
    steps than `accumulation_steps`) logs NaN.

    Args:
        per_layer: Bool. One value per layer (`grad_snr/<layer>`) or one
            over all trainable variables (`grad_snr`). Defaults to `True`.
        accumulation_steps: Int, at least 2. Steps used as micro-batches
            where replicas cannot. Defaults to `4`.
        name: String. Log key (prefix with `per_layer=True`). Defaults to
            `"grad_snr"`.
        reduction: String. `"mean"`, `"last"`, `"sum"` or `"max"`, as for
            `GradientMetric`, over the steps with a value. Defaults to
            `"mean"`.
        **kwargs: Passed on to `GradientMetric`.

    Raises:
        ValueError: `accumulation_steps` is not an int of at least 2.
    """

    _default_name = "grad_snr"
    _needs_batch_size = False

    def __init__(
        self,
        per_layer: bool = True,
        accumulation_steps: int = 4,
        name: str = "grad_snr",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        self.per_layer = _checks.check_bool("per_layer", per_layer)
        super().__init__(
            accumulation_steps=accumulation_steps, name=name, reduction=reduction, **kwargs
        )

    def _counted_values(self, grads):
        small, big, _, n, ready = self._moments(grads)
        # sum_i |g_i - m|^2 = n S - n Q.
        variance = n * (small - big) / (n - 1.0)
        snr = tf.sqrt(big) / tf.sqrt(tf.maximum(variance, 0.0))
        keys = list(self._groups(grads))
        return {key: snr[i] for i, key in enumerate(keys)}, ready

    def get_config(self):
        config = super().get_config()
        config["per_layer"] = self.per_layer
        return config


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientCosine(_PerLayerMixin, _DynamicsMetric):
    """The cosine between successive steps' gradients, as `grad_cosine`.

    `cos = <g_t, g_{t-1}> / (|g_t| |g_{t-1}|)` over all trainable variables,
    or, with `per_layer=True`, one per layer (`grad_cosine/<layer>`), of
    the global-batch gradients kept in two successive training steps. Near
    1: the steps keep one direction (a larger learning rate may be
    afforded). Near -1: each step undoes the last, the iterate oscillates
    across a valley: lower the learning rate. Near 0: successive batches
    disagree, the gradient is noise-dominated (see `GradientNoiseScale`).

    The metric keeps a float32 copy of the previous step's gradient (one
    buffer the size of the trainable variables, not saved with the model)
    and persists it across epochs, so an epoch's first step is compared
    with the previous epoch's last. The first training step has nothing to
    compare with and is not counted (an epoch of that step alone logs NaN).
    The cosine is NaN where either gradient is all zeros. Runs on
    TensorFlow, JAX and PyTorch.

    Args:
        per_layer: Bool. One value per layer instead of one global value.
            Defaults to `False`.
        name: String. Log key (prefix with `per_layer=True`). Defaults to
            `"grad_cosine"`.
        reduction: String. `"mean"`, `"last"`, `"sum"` or `"max"`, as for
            `GradientMetric`. Defaults to `"mean"`.
        **kwargs: Passed on to `GradientMetric`.
    """

    _default_name = "grad_cosine"

    def __init__(
        self,
        per_layer: bool = False,
        name: str = "grad_cosine",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        self.per_layer = _checks.check_bool("per_layer", per_layer)
        super().__init__(name=name, reduction=reduction, **kwargs)

    def _build_for(self, variables):
        super()._build_for(variables)
        self._previous([v.path for v in variables], [v.shape for v in variables])

    def _groups(self, paths):
        if self.per_layer:
            groups = _group_by_layer({p: p for p in paths})
            return {f"{self.name}/{layer}": ps for layer, ps in groups.items()}
        return {self.name: list(paths)}

    def _previous(self, paths, shapes):
        """The previous step's gradient per variable, and its squared norm
        per group, then 1 if there is a previous gradient."""
        return self._parameter_state(paths, shapes, counters=1)

    def _counted_values(self, grads):
        paths = list(grads)
        dense = {p: _float32(grads[p]) for p in paths}
        state = self._previous(paths, [dense[p].shape for p in paths])
        groups = self._groups(paths)
        held = {p: _read(state["buffers"][p]) for p in paths}
        dots = tf.stack(
            [tf.add_n([tf.reduce_sum(dense[p] * held[p]) for p in ps]) for ps in groups.values()]
        )
        squares = tf.concat([_group_squares(grads, groups), tf.ones((1,))], 0)
        previous = _read(state["counters"])
        cosine = dots / tf.sqrt(squares[:-1] * previous[:-1])
        primed = previous[-1] > 0.0
        # On TensorFlow without XLA the assignment shares the gradient's
        # buffer, as slots do.
        for p in paths:
            _assign(state["buffers"][p], dense[p])
        _assign(state["counters"], squares)
        return {key: cosine[i] for i, key in enumerate(groups)}, primed

    def get_config(self):
        config = super().get_config()
        config["per_layer"] = self.per_layer
        return config


def tensorboard_charts(model):
    """`[(title, [tag regex, ...])]`: custom-scalars charts of the dynamics
    metrics compiled into `model`, for the logs Keras's TensorBoard writes
    (`epoch_<key>`, and `batch_<key>` with a batch `update_freq`)."""
    import re

    from keras_keepgrad import metrics

    charts = []
    for metric in metrics._gradient_metrics(model):
        name = re.escape(metric.name)
        if isinstance(metric, GradientNoiseScale):
            charts.append(("Gradient noise scale (B_simple)", [f"^(epoch|batch)_{name}$"]))
            if metric.components:
                charts.append(
                    (
                        "Gradient noise scale: tr(Sigma) and |G|^2",
                        [f"^(epoch|batch)_{name}/(trace_cov|grad_sq)$"],
                    )
                )
        elif isinstance(metric, GradientSNR):
            charts.append(("Gradient signal-to-noise ratio", [f"^(epoch|batch)_{name}(/.*)?$"]))
        elif isinstance(metric, GradientCosine):
            charts.append(("Cosine of successive gradients", [f"^(epoch|batch)_{name}(/.*)?$"]))
    return charts
