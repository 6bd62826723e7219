"""`keep_gradients()`: a `KeepGradModel` over any Keras model's variables."""

import contextlib
import warnings
from typing import Any

import keras

from keras_keepgrad import _compat
from keras_keepgrad.model import FunctionalKeepGradModel
from keras_keepgrad.model import KeepGradModel

__all__ = ["WrappedKeepGradModel", "keep_gradients"]

_OPTIONS = ("keep_gradients", "save_gradients", "keep_every", "skip_bad_steps")


def _holds_saveable(value):
    """Whether Keras's saving would save state found in `value`."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_saveable(item) for item in value)
    return isinstance(value, _compat.KerasSaveable)


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class WrappedKeepGradModel(KeepGradModel):
    """What `keep_gradients()` returns for a model that is not functional.

    It stands in for the wrapped model rather than adding a level above it,
    so that its variables and files look like that model's:

    - It opens no name scope of its own: a wrapped model built by the
      wrapper's first call names its kernel `"net/dense/kernel"`, as it
      would when called itself, not `"net/net/dense/kernel"`.
    - `layers` are the wrapped model's layers, and the wrapped model's
      attributes that the wrapper does not have are read through it: its
      public ones (except those Keras sets on any model as it compiles and
      trains it, such as `optimizer`) and private ones holding Keras
      saveables (`kept.dense is model.dense`, `kept.units`,
      `kept.encode(x)`). The wrapped model itself is kept under a private
      name, so an attribute `model` of its own reads through too.
    - Keras's saving walks a model's attributes (`dir(model)`) and saves
      each saveable under its attribute name, so it writes and reads the
      same groups for the wrapper as for the wrapped model (`dense/vars/0`,
      `vars/0` for the wrapped model's own variables, `optimizer/...`):
      weights files move between the two both ways. The wrapper adds only
      `_kept_gradients`, which it writes when `save_gradients=True`.
    """

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        if isinstance(model, dict):
            model = keras.saving.deserialize_keras_object(model)
        self._wrapped = model
        # Built with the wrapped model: it has no variables of its own, and
        # Keras's `save_weights`/`load_weights` refuse an unbuilt model.
        self.built = model.built

    def call(self, inputs, training=None):
        if self._wrapped._call_has_training_arg:
            return self._wrapped(inputs, training=training)
        return self._wrapped(inputs)

    def _open_name_scope(self):
        # Keras's `Layer.__call__` and `build` open the layer's name scope
        # around building and calling; the wrapped model opens its own.
        return contextlib.nullcontext()

    @property
    def layers(self):
        return self._wrapped.layers

    def _obj_type(self):
        # Keras's saving skips the attributes every object of this type has.
        return self._wrapped._obj_type()

    def save_own_variables(self, store):
        self._wrapped.save_own_variables(store)

    def load_own_variables(self, store):
        self._wrapped.load_own_variables(store)

    def _reads_through(self, name, value):
        """Whether the wrapped model's attribute `name` shows on the wrapper."""
        if name.startswith("__") or name in _compat.MODEL_STATE_ATTRIBUTES:
            return False
        return not name.startswith("_") or _holds_saveable(value)

    def __getattr__(self, name):
        # Only reached when normal lookup fails. A property of the wrapper
        # that raised AttributeError raises it again, with its own message.
        if hasattr(type(self), name):
            return object.__getattribute__(self, name)
        try:
            # On PyTorch, `torch.nn.Module` holds submodules (the wrapped
            # model among them), parameters and buffers outside `__dict__`.
            return self._module_attribute(name)
        except AttributeError:
            pass
        model = self._wrapped_model()
        if model is not None and not name.startswith("__"):
            try:
                value = getattr(model, name)
            except AttributeError:
                pass
            else:
                if self._reads_through(name, value):
                    return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _wrapped_model(self):
        """The wrapped model, or None while `__init__` has not set it."""
        model = self.__dict__.get("_wrapped")
        if model is None:
            # On PyTorch, `torch.nn.Module` holds it among its submodules.
            model = self.__dict__.get("_modules", {}).get("_wrapped")
        return model

    def __dir__(self):
        names = set(super().__dir__())
        model = self._wrapped_model()
        if model is None:
            return sorted(names)
        names.discard("_wrapped")  # saved as this model, not below it
        for name in dir(model):
            if name in names or name.startswith("__"):
                continue
            try:
                value = getattr(model, name)
            except Exception:
                continue
            if self._reads_through(name, value):
                names.add(name)
        return sorted(names)

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self._wrapped)
        return config


_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def _overridden_steps(cls):
    """The step methods that `cls` defines outside Keras and this package."""
    found = []
    for name in _STEP_METHODS:
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if not owner.__module__.startswith(("keras.", "keras_keepgrad.")):
            found.append(name)
    return found


def keep_gradients(model: keras.Model, **options: Any) -> "KeepGradModel":
    """Returns a `KeepGradModel` that trains `model`'s own variables.

    A functional or `Sequential` model (with an `Input`) becomes a functional
    `KeepGradModel` over the same layers; any other model is wrapped. Either
    way the variables are shared, so training the result trains `model`, and
    the kept gradients are keyed by the same variable paths. If `model` was
    compiled, the result is compiled with the same arguments and the same
    optimizer object (its state carries over).

    Args:
        model: A `keras.Model`: Sequential, functional or subclassed.
        **options: `keep_gradients`, `save_gradients`, `keep_every` and
            `skip_bad_steps`, as for `KeepGradModel`.

    Returns:
        A `KeepGradModel`.

    Raises:
        TypeError: `model` is not a `keras.Model`, or an option is unknown
            or not a bool.
        ValueError: `keep_every` is not a positive int.

    Warns:
        UserWarning: `model`'s class overrides `train_step`, `test_step`,
            `predict_step`, `compute_loss` or `compute_metrics`, which the
            returned model does not run.

    Examples:
        >>> import keras, numpy as np
        >>> import keras_keepgrad as kg
        >>> plain = keras.Sequential([
        ...     keras.Input((1,)),
        ...     keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
        ...                        name="dense")], name="doc_seq")
        >>> model = kg.keep_gradients(plain)
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> history = model.fit(np.array([[1.0], [2.0]]), np.zeros((2, 1)),
        ...                     batch_size=2, verbose=0)
        >>> list(model.get_gradients_by_path())  # the original's variable paths
        ['doc_seq/dense/kernel']
        >>> model.gradients["doc_seq"]["dense"]["kernel"].numpy()
        array([[5.]], dtype=float32)
        >>> plain.get_weights()[0]  # the original model was trained
        array([[0.5]], dtype=float32)
    """
    _compat.check_backend("keep_gradients()")
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model` (Sequential, functional or "
            f"subclassed). Received: model={model!r} of type "
            f"{type(model).__name__}"
        )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"keep_gradients() got unknown options {unknown}. Valid options: {list(_OPTIONS)}"
        )
    overridden = _overridden_steps(type(model))
    if overridden:
        warnings.warn(
            f"keep_gradients(): {type(model).__name__} overrides {overridden}, "
            "which the returned model does not run: it trains, evaluates and "
            "predicts with `KeepGradModel`'s own steps. Define them on a "
            "subclass of `kg.KeepGradModel` instead: a `train_step` of your "
            "own there keeps every gradient its optimizers receive.",
            stacklevel=2,
        )
    inputs = outputs = None
    if isinstance(model, (_compat.Functional, keras.Sequential)):
        inputs, outputs = _compat.functional_structure(model)
    # Under the strategy `model` was made in, as Keras's own models take it
    # from the scope they are made in: its variables are that strategy's.
    strategy = _compat.model_strategy(model)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        if inputs is not None:
            kept = FunctionalKeepGradModel(inputs, outputs, name=model.name, **options)
        else:
            kept = WrappedKeepGradModel(model, name=model.name, **options)
        if model.compiled:
            config = _compat.compile_arguments(model)
            config["optimizer"] = model.optimizer
            kept.compile(**kept._compile_config_made_elsewhere(config, f"Model {model.name!r}"))
    return kept


# As for `KeepGradModel` (see `model.py`): the legacy `.h5` loader finds it
# by its bare class name.
keras.saving.get_custom_objects().setdefault(WrappedKeepGradModel.__name__, WrappedKeepGradModel)
