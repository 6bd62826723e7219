"""`GradientCosine`: the cosine between successive steps' gradients."""

from typing import Any

import keras

from keras_keepgrad import _checks
from keras_keepgrad._squares import group_squares
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import PerLayerMixin
from keras_keepgrad.metrics.base import as_float32
from keras_keepgrad.metrics.base import group_by_layer
from keras_keepgrad.metrics.dynamics import DynamicsMetric
from keras_keepgrad.metrics.dynamics import assign
from keras_keepgrad.metrics.dynamics import read

__all__ = ["GradientCosine"]


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientCosine(PerLayerMixin, DynamicsMetric):
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
            groups = group_by_layer({p: p for p in paths})
            return {f"{self.name}/{layer}": ps for layer, ps in groups.items()}
        return {self.name: list(paths)}

    def _previous(self, paths, shapes):
        """The previous step's gradient per variable, and its squared norm
        per group, then 1 if there is a previous gradient."""
        return self._parameter_state(paths, shapes, counters=1)

    def _counted_values(self, grads):
        paths = list(grads)
        dense = {p: as_float32(grads[p]) for p in paths}
        state = self._previous(paths, [dense[p].shape for p in paths])
        groups = self._groups(paths)
        held = {p: read(state["buffers"][p]) for p in paths}
        dots = tf.stack(
            [tf.add_n([tf.reduce_sum(dense[p] * held[p]) for p in ps]) for ps in groups.values()]
        )
        squares = tf.concat([group_squares(grads, groups), tf.ones((1,))], 0)
        previous = read(state["counters"])
        cosine = dots / tf.sqrt(squares[:-1] * previous[:-1])
        primed = previous[-1] > 0.0
        # On TensorFlow without XLA the assignment shares the gradient's
        # buffer, as slots do.
        for p in paths:
            assign(state["buffers"][p], dense[p])
        assign(state["counters"], squares)
        return {key: cosine[i] for i, key in enumerate(groups)}, primed

    def get_config(self):
        config = super().get_config()
        config["per_layer"] = self.per_layer
        return config
