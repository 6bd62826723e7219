"""Gradient metrics: Keras metrics whose values come from the kept gradients.

Pass them to `compile(metrics=[...])` of a `KeepGradModel`, beside ordinary
metrics. They are updated inside the training step, on every step (also
each step under `steps_per_execution`), and `fit` reports them in the
progress bar, `logs`, `History`, `CSVLogger` and TensorBoard like any other
metric. They skip evaluation: they are absent from `evaluate()` results and
from the `val_` logs.

Each metric's `result()` is a dict of log entries: `{name: value}` (one
scalar), or one entry per layer (`{"grad_norm/dense": ..., ...}`) for the
per-layer metrics. Keras adds those keys to the logs as they are, so a
gradient metric logs under its own name wherever it is listed, also in a
per-output metrics dict (no output-name prefix: it measures the gradients
of the total loss, not of one output). The dict is empty while there is
nothing to report (no training step since the last reset).
"""

import contextlib
import math
import numbers
from collections.abc import Callable
from typing import Any

import keras

from keras_keepgrad import _capture
from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _stats as _grad_stats
from keras_keepgrad import _torch_compile

if _compat.BACKEND in ("jax", "torch"):
    # The same arithmetic, in `keras.ops`, and the keeper's step view.
    from keras_keepgrad._ops import shared_squares as _shared_squares
    from keras_keepgrad._ops import tf_ops as tf

    if _compat.BACKEND == "jax":
        from keras_keepgrad.backend import jax as _keeper
    else:
        from keras_keepgrad.backend import torch as _keeper
else:
    import tensorflow as tf

    from keras_keepgrad._stats import shared_squares as _shared_squares
    from keras_keepgrad.backend.tensorflow import keeper as _keeper

__all__ = [
    "GradientCosine",
    "GradientMaxAbs",
    "GradientMetric",
    "GradientNoiseScale",
    "GradientNorm",
    "GradientSNR",
    "NonFiniteGradients",
    "UpdateRatio",
    "VanishingGradients",
]

_REDUCTIONS = ("mean", "last", "sum", "max")


def _float32(grad):
    return tf.cast(_keeper.densify(grad), tf.float32)


def _group_by_layer(flat):
    """`{path: x}` -> `{layer: [x, ...]}`, in variable order."""
    groups = {}
    for path, value in flat.items():
        groups.setdefault(_grad_stats.layer_of(path), []).append(value)
    return groups


def _sum_of_squares(tensors):
    # `l2_loss` (sum(t**2) / 2) is one fused kernel: about 2.5x faster on
    # CPU than `reduce_sum(square(t))`, which writes a temporary.
    return 2.0 * tf.add_n([tf.nn.l2_loss(t) for t in tensors])


def _norm(tensors):
    if not tensors:
        return tf.constant(0.0)
    return tf.sqrt(_sum_of_squares(tensors))


def _sqrt32(sum_of_squares):
    return tf.cast(tf.sqrt(sum_of_squares), tf.float32)


def _layer_squares(grads, squares):
    """`{layer: its sum of squares}` from each variable's, in variable order."""
    positions = _group_by_layer({p: i for i, p in enumerate(grads)})
    return {layer: tf.add_n([squares[i] for i in indices]) for layer, indices in positions.items()}


class _Holder:
    """Keeps plain `tf.Variable`s out of Keras's tracking (and saved files)."""

    def __init__(self):
        self.variables = {}


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientMetric(keras.metrics.Metric):
    """A metric whose value is a function of each training step's gradients.

    On every training step of a `KeepGradModel`, `fn` receives that step's
    kept gradients (the structure of `model.gradients`: a nested dict like
    `model.get_state_tree()["trainable_variables"]` of dense tensors, after
    loss-scale unscaling, before any optimizer transformation, sparse
    gradients densified, frozen variables absent), cast to float32, and
    returns a scalar. The metric reduces the values of the epoch's steps as
    `reduction` says and is logged by `fit` under `name`.

    Evaluation steps leave it untouched, and it is absent from `evaluate()`
    results and from the `val_` logs. Compiled into a `KeepGradModel` with
    `keep_gradients=False`, `fit` refuses it as it starts; into a plain
    `keras.Model`, it raises at the first step. In a `KeepGradModel`, an
    error in the first step of its training function (the step kept
    nothing, or `fn` raised or returned no scalar) leaves the weights, the
    optimizer and the metrics as they were.

    `result()` returns a dict: `{name: value}`, or `{}` while no training
    step was seen since the last reset.

    Saving: `fn` is saved by reference like any Keras custom function.
    Register it with `@keras.saving.register_keras_serializable()` (or pass
    it in `custom_objects` when loading). A lambda follows Keras's rule for
    lambdas: saving warns, and loading needs `safe_mode=False`.

    Args:
        fn: Callable. Takes the nested dict of float32 gradient tensors and
            returns a scalar (a 0-d tensor or a Python number).
        name: String. The log key. Defaults to `fn.__name__`
            (`"gradient_metric"` for a lambda); None means that default.
        reduction: String. How the epoch's step values combine: `"mean"`
            (averaged over the steps, as Keras averages its metrics),
            `"last"` (the latest step: what spikes show in), `"sum"`, or
            `"max"`. Defaults to `"mean"`.
        **kwargs: Passed on to `keras.metrics.Metric`. Gradient metrics
            always compute in float32.

    Raises:
        TypeError: `fn` is not callable.
        ValueError: `reduction` is not one of the above, or a `dtype` other
            than float32 is requested.

    Examples:
        ```python
        # With a layer `keras.layers.Dense(..., name="dense")`:
        def max_kernel_grad(grads):
            return keras.ops.max(keras.ops.abs(grads["dense"]["kernel"]))

        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      metrics=["mae", kg.metrics.GradientNorm(),
                               kg.metrics.GradientMetric(max_kernel_grad,
                                                         reduction="last")])
        history = model.fit(x, y, epochs=2)
        history.history["max_kernel_grad"]  # one value per epoch
        ```
    """

    # The log key that `name=None` stands for; None: from `fn`.
    _default_name = None

    def __init__(
        self,
        fn: Callable[[dict], Any] | None,
        name: str | None = None,
        reduction: str = "mean",
        **kwargs: Any,
    ) -> None:
        dtype = kwargs.pop("dtype", None)
        if dtype is not None and keras.backend.standardize_dtype(dtype) != "float32":
            raise ValueError(
                "Gradient metrics compute in float32. Received: "
                f"dtype={dtype!r}. Leave `dtype` unset."
            )
        overridden = (
            type(self)._step_values is not GradientMetric._step_values
            or type(self)._measure is not GradientMetric._measure
        )
        if fn is None and not overridden:
            raise TypeError(
                "`fn` must be a callable taking the nested dict of gradients "
                "and returning a scalar. Received: fn=None"
            )
        if fn is not None and not callable(fn):
            raise TypeError(
                "`fn` must be a callable taking the nested dict of gradients "
                f"and returning a scalar. Received: fn={fn!r} of type "
                f"{type(fn).__name__}"
            )
        if reduction not in _REDUCTIONS:
            raise ValueError(
                "`reduction` must be one of "
                f"{', '.join(repr(r) for r in _REDUCTIONS)}. Received: "
                f"reduction={reduction!r}"
            )
        if name is not None and (not isinstance(name, str) or not name):
            # Keras would replace an empty name with the class's snake-case
            # name, unlike this metric's default: say so instead.
            raise (ValueError if isinstance(name, str) else TypeError)(
                "`name` must be a non-empty string, the metric's log key, or "
                f"None for its default. Received: name={name!r} of type "
                f"{type(name).__name__}"
            )
        if name is None:
            # As for Keras metrics, `name=None` means the default name.
            fn_name = getattr(fn, "__name__", None)
            name = self._default_name or (
                fn_name if fn_name and fn_name != "<lambda>" else "gradient_metric"
            )
        super().__init__(name=name, dtype="float32", **kwargs)
        self.fn = fn
        self.reduction = reduction
        # Training steps seen since the last reset.
        self._count = self.add_variable(
            shape=(), initializer="zeros", aggregation="mean", name="count"
        )
        # Steps that counted, for metrics whose `_measure` may skip a step.
        self._counted = None
        # `{log key: variable}`; per-layer metrics only learn their keys
        # (the layers) in the first training step.
        self._state = {}
        self._keys = ()
        keys = self._keys_for(None)
        if keys is not None:
            self._build_state(keys)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass's own `update_state` and `result` read the step's kept
        # gradients too: outside `torch.compile`, as the base class's.
        for name in ("update_state", "result"):
            method = vars(cls).get(name)
            if method is not None:
                setattr(cls, name, _torch_compile.eager(method))

    # What subclasses define -------------------------------------------

    def _keys_for(self, paths):
        """The log keys for these variable paths; None if `paths` is None
        and the keys depend on them (per-layer metrics)."""
        del paths
        return (self.name,)

    def _build_for(self, variables):
        """Creates the state for training these variables, before tracing.

        Called in the scope of the model's `tf.distribute` strategy.
        """
        self._follow_strategy()
        self._build_state(self._keys_for([v.path for v in variables]))

    def _step_values(self, grads):
        """`{log key: float32 scalar}` of one step, from `{path: grad}`.

        The base class calls `fn` on the nested float32 gradients.
        """
        nested = _keeper.nest_by_path({p: _float32(g) for p, g in grads.items()})
        value = self.fn(nested)
        if value is None:
            raise ValueError(
                f"The `fn` of GradientMetric {self.name!r} must return a scalar. Received: None"
            )
        value = tf.convert_to_tensor(value)
        if value.ndim != 0:
            raise ValueError(
                f"The `fn` of GradientMetric {self.name!r} must return a "
                f"scalar. Received: a tensor of shape {tuple(value.shape)}. Reduce "
                "it to one number (e.g. with `keras.ops.max`), or use one "
                "GradientMetric per value."
            )
        return {self.name: tf.cast(value, tf.float32)}

    def _measure(self, grads):
        """`(values, counted)`: `counted` is None, or a bool tensor saying
        whether this step counts at all."""
        return self._step_values(grads), None

    # State ------------------------------------------------------------

    def _initial_value(self):
        return float("-inf") if self.reduction == "max" else 0.0

    def _build_state(self, keys):
        missing = [k for k in keys if k not in self._state]
        if not missing:
            return
        # Created in the first (traced) step for per-layer metrics:
        # `init_scope` lifts the variables out of the function being traced.
        with tf.init_scope():
            for key in missing:
                self._state[key] = self.add_variable(
                    shape=(),
                    initializer=keras.initializers.Constant(self._initial_value()),
                    aggregation="mean",
                    name=f"value_{len(self._state)}",
                )

    def _follow_strategy(self):
        """Remakes, in the current `tf.distribute` strategy's scope, the
        state variables made outside it (by a metric made outside it).

        In the scope every replica adds the same global value to its own
        copy, and reading averages the copies (`aggregation="mean"`). Every
        replica adds to one variable made outside: it would hold the sums
        and counts once per replica, beside the per-layer values made in
        the scope that hold them once. (Keras's own metrics read the same
        either way: each replica adds its share, and `aggregation="sum"`
        totals the copies.)
        """
        if _compat.BACKEND != "tensorflow" or not tf.distribute.has_strategy():
            return
        extended = tf.distribute.get_strategy().extended

        def in_scope(variable):
            if variable is None or extended.variable_created_in_scope(variable.value):
                return variable
            remade = self.add_variable(
                shape=variable.shape,
                initializer=keras.initializers.Constant(variable.numpy()),
                aggregation=variable.aggregation,
                name=variable.name,
            )
            _compat.replace_metric_variable(self, variable, remade)
            return remade

        self._count = in_scope(self._count)
        self._counted = in_scope(self._counted)
        for key, variable in self._state.items():
            self._state[key] = in_scope(variable)

    def reset_state(self):
        self._count.assign(0.0)
        if self._counted is not None:
            self._counted.assign(0.0)
        for variable in self._state.values():
            variable.assign(self._initial_value())

    def update_state(self, y_true=None, y_pred=None, sample_weight=None):
        """Adds this training step's value; does nothing in evaluation.

        `y_true`, `y_pred` and `sample_weight` are ignored: the value comes
        from the step's kept gradients.

        Raises:
            ValueError: called in a training step that keeps no gradients
                (a plain `keras.Model`, or `keep_gradients=False`), or `fn`
                returned something other than a scalar.
        """
        del y_true, y_pred, sample_weight
        grads = _keeper.current_step_gradients()
        if grads is None:
            if _keeper.in_evaluation_step() or _compat.in_symbolic_build():
                return
            raise ValueError(
                f"Gradient metric {self.name!r} ({type(self).__name__}) ran "
                "in a step that keeps no gradients: it only works in the "
                "training step of a model that keeps them. Build the model "
                "with `keras_keepgrad.KeepGradModel(inputs, outputs)` or "
                "wrap it with `keras_keepgrad.keep_gradients(model)`, with "
                "`keep_gradients=True` (the default), and compile that model "
                "with this metric."
            )
        if not grads and _capture.current_step().expects_gradients:
            raise ValueError(
                f"Gradient metric {self.name!r} ({type(self).__name__}) was "
                "updated in a training step before any optimizer received "
                "gradients, so there is nothing to measure. In your own "
                "`train_step`, update the metrics (`self.compute_metrics(...)` "
                "or `metric.update_state(...)`) after `optimizer.apply(...)`; "
                "for variables updated without an optimizer, pass the "
                "gradients through `self.keep_step_gradients(grads, "
                "variables)` first."
            )
        values, counted = self._measure(grads)
        self._build_state(values)
        self._keys = tuple(values)
        weight = 1.0 if counted is None else tf.cast(counted, tf.float32)
        for key, value in values.items():
            variable = self._state[key]
            if self.reduction in ("mean", "sum"):
                variable.assign_add(value * weight)
            elif self.reduction == "last":
                new = value if counted is None else tf.where(counted, value, variable)
                variable.assign(new)
            else:
                new = tf.maximum(variable, value)
                variable.assign(new if counted is None else tf.where(counted, new, variable))
        self._count.assign_add(1.0)
        if self._counted is not None:
            self._counted.assign_add(weight)

    def result(self):
        """The reduced values as `{log key: float32 scalar}`.

        Returns `{}` when there is nothing to report: in evaluation, and
        while no training step was seen since the last reset. The values
        are new tensors, which later updates and resets leave unchanged.
        """
        if not self._keys:
            return {}
        if _keeper.current_step_gradients() is None:
            if _keeper.in_evaluation_step() or _compat.in_symbolic_build():
                return {}
            if tf.executing_eagerly() and float(self._count.numpy()) == 0.0:
                return {}
        count = tf.convert_to_tensor(self._count if self._counted is None else self._counted)
        results = {}
        # No step counted (an `UpdateRatio` that saw no optimizer update):
        # NaN, not a made-up 0.
        nothing = tf.constant(float("nan"))
        for key in self._keys:
            # A copy, never the variable's own tensor: Keras's PyTorch
            # trainer holds the epoch's results through validation, which
            # resets the variables in place.
            value = tf.identity(tf.convert_to_tensor(self._state[key]))
            if self.reduction == "mean":
                value = tf.where(count > 0, tf.math.divide_no_nan(value, count), nothing)
            elif self.reduction == "max":
                value = tf.where(count > 0, value, nothing)
            results[key] = value
        return results

    # Under `torch.compile`, run as in an eager step (`_torch_compile`).
    update_state = _torch_compile.eager(update_state)
    result = _torch_compile.eager(result)

    # Serialization ----------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)
        config["reduction"] = self.reduction
        if self.fn is not None:
            config["fn"] = keras.saving.serialize_keras_object(self.fn)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("fn"), dict):
            config["fn"] = keras.saving.deserialize_keras_object(config["fn"])
        return cls(**config)


class _PerLayerMixin:
    """Keys `name/<layer>` when `per_layer=True`, else the one key `name`."""

    def _keys_for(self, paths):
        if not self.per_layer:
            return (self.name,)
        if paths is None:
            return None
        layers = dict.fromkeys(_grad_stats.layer_of(p) for p in paths)
        return tuple(f"{self.name}/{layer}" for layer in layers)

    def _per_layer(self, groups, measure):
        """`{name/<layer>: measure(that layer's items)}`."""
        return {f"{self.name}/{layer}": measure(ts) for layer, ts in groups.items()}


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class GradientNorm(_PerLayerMixin, GradientMetric):
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
        squares = _shared_squares(grads)
        if not self.per_layer:
            return {self.name: _sqrt32(tf.reduce_sum(squares))}
        layers = _layer_squares(grads, squares)
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
        maxima = [tf.reduce_max(tf.abs(_float32(g))) for g in grads.values()]
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
        squares = _shared_squares(grads)

        def entries_finite():
            finite = [tf.reduce_all(tf.math.is_finite(_float32(g))) for g in grads.values()]
            return tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)

        all_finite = tf.cond(
            tf.reduce_all(tf.math.is_finite(squares)), lambda: tf.constant(True), entries_finite
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
        layers = _layer_squares(grads, _shared_squares(grads))
        small = [tf.cast(_sqrt32(s) < self.threshold, tf.float32) for s in layers.values()]
        return {self.name: tf.add_n(small) / float(len(small))}

    def get_config(self):
        config = super().get_config()
        config["threshold"] = self.threshold
        return config


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class UpdateRatio(_PerLayerMixin, GradientMetric):
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
        self._copies = _Holder()
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
            values = self._per_layer(_group_by_layer({p: p for p in grads}), ratio)
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
            return self._per_layer(_group_by_layer({p: p for p in grads}), ratio), None
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


def _gradient_metrics(model):
    found = []
    # `CompileMetrics` holds the metrics passed to `compile`: once built in
    # its `metrics`, before that only as they were passed.
    passed = keras.tree.flatten(_compat.compiled_metrics_as_passed(model))
    for metric in [*model.metrics, *passed]:
        for m in [metric, *getattr(metric, "metrics", ())]:
            if isinstance(m, GradientMetric) and not any(m is f for f in found):
                found.append(m)
    return found


def _measures_updates(model):
    """Whether one of `model`'s gradient metrics is an `UpdateRatio` (internal)."""
    return any(isinstance(m, UpdateRatio) for m in _gradient_metrics(model))


def build_gradient_metrics(model):
    """Creates the state of `model`'s gradient metrics (internal).

    `KeepGradModel.make_train_function` calls it before the training step is
    traced, as Keras builds the optimizer: per-layer metrics learn their
    layers, and `UpdateRatio` copies the weights from before the first step
    (also under `run_eagerly=True`). Metrics built otherwise create their
    state in the first step.
    """
    metrics = _gradient_metrics(model)
    if not metrics:
        return
    variables = list(model.trainable_variables)
    strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's only
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        for metric in metrics:
            metric._build_for(variables)


def _check_gradients_kept(model):
    """Raises if `model` keeps no gradients but has gradient metrics (internal).

    Called by `make_train_function`, before the first step changes
    anything: the metrics would raise in that step, after its update on
    the backends that run it eagerly.
    """
    if model._keep_gradients:
        return
    metrics = _gradient_metrics(model)
    if metrics:
        metric = metrics[0]
        raise ValueError(
            f"Gradient metric {metric.name!r} ({type(metric).__name__}) was "
            f"compiled into model {model.name!r}, which keeps no gradients: "
            "it measures the kept ones. Set `model.keep_gradients = True` "
            "before `fit` (a `KeepGradModel` keeps them by default), or "
            "compile without the metric. Received: keep_gradients=False"
        )


def _untracked_state(model):
    """Copies the state that `model`'s gradient metrics hold outside Keras's
    tracking (`_Holder`s); returns a function that puts it back (internal).

    What a step made there is dropped, to be made again by the next step.
    Only TensorFlow's metrics hold such state.
    """
    saved = []
    if _compat.BACKEND != "tensorflow":
        return lambda: None
    for metric in _gradient_metrics(model):
        for holder in vars(metric).values():
            if isinstance(holder, _Holder):
                contents = dict(holder.variables)
                variables = [v for v in keras.tree.flatten(contents) if isinstance(v, tf.Variable)]
                values = [tf.identity(v) for v in variables]
                saved.append((holder, contents, variables, values))

    def restore():
        for holder, contents, variables, values in saved:
            holder.variables.clear()
            holder.variables.update(contents)
            for variable, value in zip(variables, values):
                variable.assign(value)

    return restore


def _alike(a, b):
    """Whether two gradient metrics measure the same: one per output of a
    multi-output model logs one value, as they measure the total loss's
    gradients. The same `fn` object, not its serialized form (serializing
    a lambda warns)."""
    if type(a) is not type(b) or a.fn is not b.fn:
        return False
    if a.fn is not None:
        return a.reduction == b.reduction
    return a.get_config() == b.get_config()


def _check_unique_keys(model):
    """Raises if two of `model`'s gradient metrics would log under one key (internal).

    Keras flattens each metric's `{key: value}` into the logs, where the
    later of two equal keys would silently replace the earlier. Called
    before `make_train_function` changes anything.
    """
    metrics = _gradient_metrics(model)
    paths = [v.path for v in model.trainable_variables]
    owners = {}
    for metric in metrics:
        for key in metric._keys_for(paths) or ():
            other = owners.setdefault(key, metric)
            if other is not metric and not _alike(other, metric):
                raise ValueError(
                    "Two gradient metrics in `compile(metrics=...)` log under "
                    f"the same name {key!r}: "
                    f"{type(other).__name__}(name={other.name!r}) and "
                    f"{type(metric).__name__}(name={metric.name!r}), so one "
                    "would hide the other in the logs and History. Give "
                    f"each its own `name=...`, e.g. {type(metric).__name__}"
                    f"(..., name={metric.name + '_2'!r})."
                )


# Defined apart (they build on the classes above), public from here.
from keras_keepgrad._dynamics import GradientCosine  # noqa: E402
from keras_keepgrad._dynamics import GradientNoiseScale  # noqa: E402
from keras_keepgrad._dynamics import GradientSNR  # noqa: E402
