"""`GradientNoiseScale` and `GradientSNR`: what the small batches' gradients
say about the gradient noise (`metrics.dynamics` says how they are found)."""

import numbers
from typing import Any

import keras

from keras_keepgrad import _checks
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import PerLayerMixin
from keras_keepgrad.metrics.dynamics import SmallBatches
from keras_keepgrad.metrics.dynamics import assign
from keras_keepgrad.metrics.dynamics import read

__all__ = ["GradientNoiseScale", "GradientSNR"]


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientNoiseScale(SmallBatches):
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
        previous = read(average)
        new = beta * previous + (1.0 - beta) * tf.stack([grad_sq, trace, tf.constant(1.0)])
        new = tf.where(ready, new, previous)
        assign(average, new)
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
class GradientSNR(PerLayerMixin, SmallBatches):
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
