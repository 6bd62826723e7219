"""`UpdateRatio`: the size of each step's weight update relative to the weights."""

from typing import Any

import keras

from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad._squares import total_squares
from keras_keepgrad.metrics._backend import keeper as _keeper
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import GradientMetric
from keras_keepgrad.metrics.base import Holder
from keras_keepgrad.metrics.base import PerLayerMixin
from keras_keepgrad.metrics.base import group_by_layer

__all__ = ["UpdateRatio"]


def _norm(tensors):
    if not tensors:
        return tf.constant(0.0)
    return tf.sqrt(total_squares(tensors))


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class UpdateRatio(PerLayerMixin, GradientMetric):
    """The size of each step's weight update relative to the weights.

    Logged as `update_ratio`: `‖w_after - w_before‖ / ‖w_before‖` over all
    trainable variables, or, with `per_layer=True`, one ratio per layer
    (over its trainable variables) logged as `update_ratio/<layer>`. This is
    the update that actually happened, whatever the optimizer (Adam's
    normalized steps, momentum, clipping, weight decay and constraints
    included): the metric keeps a float32 copy of every trainable variable
    from the previous step, which costs one model's worth of memory, and
    compares. A rule of thumb reads ratios around `1e-3` as healthy.

    The copies are first taken when `fit` (or `train_on_batch`) builds the
    training function, before its first step. Caveats, by construction: a
    ratio is 0 where the weights before were all zero; anything else that
    changes the weights between two training steps (e.g. `set_weights`)
    counts as part of the next update; and a step that finds no copy from
    before its update (only when `train_step` is run eagerly by hand) is
    not counted.

    Args:
        per_layer: Bool. One value per layer instead of one global value.
            Defaults to `False`.
        name: String. Log key (prefix with `per_layer=True`). Defaults to
            `"update_ratio"`.
        reduction: String. `"mean"`, `"last"`, `"sum"` or `"max"`, as for
            `GradientMetric`. Defaults to `"mean"`.
        **kwargs: Passed on to `GradientMetric`.

    Examples:
        ```python
        # One weight w = 3, grad 5w = 15, SGD(0.1): w -> 1.5, ratio 1.5 / 3.
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      metrics=[kg.metrics.UpdateRatio()])
        model.fit(x, y, batch_size=2).history["update_ratio"]  # [0.5]
        ```
    """

    _default_name = "update_ratio"

    def __init__(
        self,
        per_layer: bool = False,
        name: str = "update_ratio",
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        self.per_layer = _checks.check_bool("per_layer", per_layer)
        super().__init__(fn=None, name=name, reduction=reduction, **kwargs)
        self._copies = Holder()
        self._counted = self.add_variable(
            shape=(), initializer="zeros", aggregation="mean", name="counted"
        )

    def _measure(self, grads):
        if _compat.BACKEND != "tensorflow":
            return self._measure_from_updates(grads)
        variables = _keeper.current_step_variables()
        if variables is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} needs the variables "
                "trained in the step, which this model does not provide."
            )
        deltas, befores, primed = {}, {}, []
        for path in grads:
            variable = variables[path]
            now = tf.cast(tf.convert_to_tensor(variable), tf.float32)
            previous, is_primed = self._copy_of(path, variable)
            befores[path] = tf.convert_to_tensor(previous)
            deltas[path] = now - befores[path]
            primed.append(tf.convert_to_tensor(is_primed))
            previous.assign(now)
            is_primed.assign(True)

        def ratio(paths):
            return tf.math.divide_no_nan(
                _norm([deltas[p] for p in paths]), _norm([befores[p] for p in paths])
            )

        if self.per_layer:
            values = self._per_layer(group_by_layer({p: p for p in grads}), ratio)
        else:
            values = {self.name: ratio(list(grads))}
        counted = tf.reduce_all(tf.stack(primed)) if primed else None
        return values, counted

    def _measure_from_updates(self, grads):
        # On JAX the step sees each update's before and after values, as
        # `stateless_apply` takes and returns them: no copies are kept. On
        # PyTorch the keeper copies the values before each update.
        updates = _keeper.current_step_updates()
        if any(path not in updates for path in grads):
            # Updated without an optimizer: not seen, not counted.
            keys = self._keys_for(list(grads))
            return {key: tf.constant(0.0) for key in keys}, tf.constant(False)
        deltas, befores = {}, {}
        for path in grads:
            before, after = updates[path]
            befores[path] = tf.cast(before, tf.float32)
            deltas[path] = tf.cast(after, tf.float32) - befores[path]

        def ratio(paths):
            return tf.math.divide_no_nan(
                _norm([deltas[p] for p in paths]), _norm([befores[p] for p in paths])
            )

        if self.per_layer:
            return self._per_layer(group_by_layer({p: p for p in grads}), ratio), None
        return {self.name: ratio(list(grads))}, None

    def _build_for(self, variables):
        super()._build_for(variables)
        if _compat.BACKEND != "tensorflow":
            return
        for variable in variables:
            self._copy_of(variable.path, variable, before_update=True)

    def _copy_of(self, path, variable, before_update=None):
        """The float32 copy of `variable` from the previous step, and
        whether it holds the weights from before this step's update."""
        copies = self._copies.variables
        if path not in copies or tuple(copies[path][0].shape) != tuple(variable.shape):
            if before_update is None:
                # Made in the step: while tracing, the value is read before
                # the step runs; eagerly, the update already happened.
                before_update = not tf.executing_eagerly()
            with tf.init_scope():
                value = tf.cast(tf.convert_to_tensor(variable), tf.float32)
                # One local copy per replica, as each replica updates it.
                local = dict(
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
                copies[path] = (
                    tf.Variable(value, **local),
                    tf.Variable(before_update, **local),
                )
        return copies[path]

    def get_config(self):
        config = super().get_config()
        config["per_layer"] = self.per_layer
        return config
