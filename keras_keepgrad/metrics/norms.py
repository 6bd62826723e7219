"""The norm metrics: `GradientNorm`, `GradientMaxAbs`, `NonFiniteGradients`,
`VanishingGradients`.

Those that need sums of squares take the step's per-variable sums
(`_squares.shared_squares`), computed once for all of them and for the
callbacks' statistics.
"""

import math
import numbers
from typing import Any

import keras

from keras_keepgrad import _checks
from keras_keepgrad._squares import entries_finite
from keras_keepgrad._squares import layer_squares
from keras_keepgrad._squares import shared_squares
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import GradientMetric
from keras_keepgrad.metrics.base import PerLayerMixin
from keras_keepgrad.metrics.base import as_float32

__all__ = ["GradientMaxAbs", "GradientNorm", "NonFiniteGradients", "VanishingGradients"]


def _sqrt32(sum_of_squares):
    return tf.cast(tf.sqrt(sum_of_squares), tf.float32)


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientNorm(PerLayerMixin, GradientMetric):
    """The L2 norm of each step's gradients, logged as `grad_norm`.

    The global norm is `sqrt(sum of every squared gradient entry)` over all
    trainable variables, as `tf.linalg.global_norm` (and the optimizer's
    `global_clipnorm`) computes it, but on the unscaled, unclipped
    gradients. With `per_layer=True` it is one norm per layer (over that
    layer's trainable variables, e.g. kernel and bias), logged as
    `grad_norm/<layer>`, where `<layer>` is the variables' path without
    their own name (`dense` for `dense/kernel`).

    Args:
        per_layer: Bool. One value per layer instead of one global value.
            Defaults to `False`.
        name: String. Log key (prefix with `per_layer=True`). Defaults to
            `"grad_norm"`.
        reduction: String. `"mean"`, `"last"`, `"sum"` or `"max"`, as for
            `GradientMetric`. Defaults to `"mean"`.
        **kwargs: Passed on to `GradientMetric`.

    Examples:
        One weight w = 3, x = [[1], [2]], y = 0, mse: the gradient is 5w = 15,
        and SGD(0.1) halves w every step:

        >>> import keras, numpy as np
        >>> import keras_keepgrad as kg
        >>> inputs = keras.Input((1,))
        >>> dense = keras.layers.Dense(
        ...     1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0))
        >>> model = kg.KeepGradModel(inputs, dense(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
        ...               metrics=[kg.metrics.GradientNorm()])
        >>> history = model.fit(np.array([[1.0], [2.0]]), np.zeros((2, 1)),
        ...                     batch_size=2, epochs=3, verbose=0)
        >>> history.history["grad_norm"]
        [15.0, 7.5, 3.75]
    """

    _default_name = "grad_norm"

    def __init__(
        self,
        per_layer: bool = False,
        name: str = "grad_norm",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        self.per_layer = _checks.check_bool("per_layer", per_layer)
        super().__init__(fn=None, name=name, reduction=reduction, **kwargs)

    def _step_values(self, grads):
        # The step's sums of squares, shared with the other norm metrics
        # and the callbacks' statistics.
        squares = shared_squares(grads)
        if not self.per_layer:
            return {self.name: _sqrt32(tf.reduce_sum(squares))}
        layers = layer_squares(grads, squares)
        return {f"{self.name}/{layer}": _sqrt32(s) for layer, s in layers.items()}

    def get_config(self):
        config = super().get_config()
        config["per_layer"] = self.per_layer
        return config


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientMaxAbs(GradientMetric):
    """The largest absolute gradient entry, logged as `grad_max_abs`.

    Over all trainable variables of the step. By default the epoch value is
    the largest of its steps' values (`reduction="max"`).

    Args:
        name: String. Log key. Defaults to `"grad_max_abs"`.
        reduction: String. `"max"`, `"mean"`, `"last"` or `"sum"`, as for
            `GradientMetric`. Defaults to `"max"`.
        **kwargs: Passed on to `GradientMetric`.
    """

    _default_name = "grad_max_abs"

    def __init__(self, name: str = "grad_max_abs", reduction: str = "max", **kwargs: Any) -> None:
        super().__init__(fn=None, name=name, reduction=reduction, **kwargs)

    def _step_values(self, grads):
        maxima = [tf.reduce_max(tf.abs(as_float32(g))) for g in grads.values()]
        if not maxima:
            return {self.name: tf.constant(0.0)}
        return {self.name: tf.reduce_max(tf.stack(maxima))}


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class NonFiniteGradients(GradientMetric):
    """Counts the steps with any inf or NaN gradient, as `grad_nonfinite`.

    By default (`reduction="sum"`) the epoch value is the number of such
    steps in the epoch. The gradients are the unscaled ones the optimizer
    receives, so under `keras.optimizers.LossScaleOptimizer` (and the
    `mixed_float16` policy) this counts exactly the steps that dynamic loss
    scaling skipped. With `reduction="mean"` it is their fraction.

    Args:
        name: String. Log key. Defaults to `"grad_nonfinite"`.
        reduction: String. `"sum"`, `"mean"`, `"last"` or `"max"`, as for
            `GradientMetric`. Defaults to `"sum"`.
        **kwargs: Passed on to `GradientMetric`.
    """

    _default_name = "grad_nonfinite"

    def __init__(self, name: str = "grad_nonfinite", reduction: str = "sum", **kwargs: Any) -> None:
        super().__init__(fn=None, name=name, reduction=reduction, **kwargs)

    def _step_values(self, grads):
        # A finite sum of squares has finite entries; a non-finite one may
        # be a float32 overflow, which the entries themselves tell apart.
        squares = shared_squares(grads)
        all_finite = tf.cond(
            tf.reduce_all(tf.math.is_finite(squares)),
            lambda: tf.constant(True),
            lambda: entries_finite([as_float32(g) for g in grads.values()]),
        )
        return {self.name: 1.0 - tf.cast(all_finite, tf.float32)}


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class VanishingGradients(GradientMetric):
    """The fraction of layers whose gradient norm is below `threshold`.

    Logged as `grad_vanishing`. A layer's norm is taken over its trainable
    variables (as `GradientNorm(per_layer=True)`); a layer the loss does not
    reach has a zero gradient and counts as vanishing. Frozen layers are not
    counted at all.

    Args:
        threshold: Float. A layer whose gradient norm is strictly below it
            counts. Defaults to `1e-7`.
        name: String. Log key. Defaults to `"grad_vanishing"`.
        reduction: String. `"mean"`, `"last"`, `"sum"` or `"max"`, as for
            `GradientMetric`. Defaults to `"mean"`.
        **kwargs: Passed on to `GradientMetric`.

    Raises:
        ValueError: `threshold` is negative, not finite, or not a number.
    """

    _default_name = "grad_vanishing"

    def __init__(
        self,
        threshold: float = 1e-7,
        name: str = "grad_vanishing",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, numbers.Real)
            or not math.isfinite(threshold)
            or threshold < 0
        ):
            raise ValueError(
                "`threshold` must be a finite, non-negative number. Received: "
                f"threshold={threshold!r}"
            )
        self.threshold = float(threshold)
        super().__init__(fn=None, name=name, reduction=reduction, **kwargs)

    def _step_values(self, grads):
        if not grads:
            return {self.name: tf.constant(0.0)}
        layers = layer_squares(grads, shared_squares(grads))
        small = [tf.cast(_sqrt32(s) < self.threshold, tf.float32) for s in layers.values()]
        return {self.name: tf.add_n(small) / float(len(small))}

    def get_config(self):
        config = super().get_config()
        config["threshold"] = self.threshold
        return config
