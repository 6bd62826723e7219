"""`GradientMetric`: a Keras metric whose value comes from the kept gradients.

The base class of every gradient metric, with what they share: the float32
view of a gradient (`as_float32`), the grouping of variable paths by layer
(`group_by_layer`), the per-layer log keys (`PerLayerMixin`) and the holder
of state kept out of Keras's tracking (`Holder`).
"""

from collections.abc import Callable
from typing import Any

import keras

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad import _torch_compile
from keras_keepgrad._paths import layer_of
from keras_keepgrad.metrics._backend import keeper as _keeper
from keras_keepgrad.metrics._backend import tf

__all__ = ["GradientMetric", "Holder", "PerLayerMixin", "as_float32", "group_by_layer", "write"]

_REDUCTIONS = ("mean", "last", "sum", "max")


def as_float32(grad):
    """A kept gradient as a dense float32 tensor."""
    return tf.cast(_keeper.densify(grad), tf.float32)


def write(variable, value, add=False):
    """`variable.assign(value)` (`assign_add` where `add`) of a metric's
    Keras variable; on PyTorch in place (`_compat.torch_assign`), which
    saves Keras's conversion, checks and (adding) second pass, tens of µs a
    write in a step there."""
    if _compat.BACKEND == "torch":
        _compat.torch_assign(variable, value, add=add)
    else:
        (variable.assign_add if add else variable.assign)(value)


def group_by_layer(flat):
    """`{path: x}` -> `{layer: [x, ...]}`, in variable order."""
    groups = {}
    for path, value in flat.items():
        groups.setdefault(layer_of(path), []).append(value)
    return groups


class Holder:
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
        nested = _keeper.nest_by_path({p: as_float32(g) for p, g in grads.items()})
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
                write(variable, value * weight, add=True)
            elif self.reduction == "last":
                write(variable, value if counted is None else tf.where(counted, value, variable))
            else:
                new = tf.maximum(variable, value)
                write(variable, new if counted is None else tf.where(counted, new, variable))
        write(self._count, 1.0, add=True)
        if self._counted is not None:
            write(self._counted, weight, add=True)

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


class PerLayerMixin:
    """Keys `name/<layer>` when `per_layer=True`, else the one key `name`."""

    def _keys_for(self, paths):
        if not self.per_layer:
            return (self.name,)
        if paths is None:
            return None
        layers = dict.fromkeys(layer_of(p) for p in paths)
        return tuple(f"{self.name}/{layer}" for layer in layers)

    def _per_layer(self, groups, measure):
        """`{name/<layer>: measure(that layer's items)}`."""
        return {f"{self.name}/{layer}": measure(ts) for layer, ts in groups.items()}
