"""The `KeepGradModel` classes that stand in for Keras's in the kept copies.

`run.py` copies Keras's own test files and, in the "kept" copy, calls
`substitute(globals())` after each file's imports, so that every model the
file builds, subclasses or mixes in trains through `KeepGradModel`:

- `Model` (`keras.Model`, `keras.src.models.Model`, ...) -> `KeepGradModel`
  (`Model(inputs, outputs)` then builds a functional `KeepGradModel`, and
  `class Net(Model)` is a `KeepGradModel` subclass),
- `Functional` -> the class `KeepGradModel(inputs, outputs)` builds,
- `Sequential` -> `KeepGradSequential`, a `KeepGradModel` with Sequential's
  structure (`add`, `pop`, its config),
- the running backend's trainer (trainer_test.py's `Trainer` mix-in base:
  `TensorFlowTrainer`, `JAXTrainer` or `TorchTrainer`) -> `KeepGradTrainer`,
- the modules `keras`, `keras.models` and `keras.src.models` -> views of
  them that give the classes above.

Only the test file's own names change: Keras's internals (`clone_model`,
deserialization of a plain config, Sequential's inner `Functional`) keep
building Keras's classes.

Written against Keras 3.15 (TensorFlow, JAX and PyTorch backends).
"""

import importlib
import types

import keras
from keras.src import models as src_models
from keras.src.layers.layer import Layer
from keras.src.models.functional import Functional
from keras.src.models.model import Model
from keras.src.models.sequential import Sequential

import keras_keepgrad as kg

__all__ = [
    "KeepGradSequential",
    "KeepGradTrainer",
    "backend_trainer",
    "functional_class",
    "substitute",
]

# The trainer class of each backend, as trainer_test.py imports it.
_TRAINERS = {
    "tensorflow": ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
    "jax": ("keras.src.backend.jax.trainer", "JAXTrainer"),
    "torch": ("keras.src.backend.torch.trainer", "TorchTrainer"),
}


def backend_trainer():
    """The running backend's trainer class (trainer_test.py's `Trainer`)."""
    module, name = _TRAINERS[keras.backend.backend()]
    return getattr(importlib.import_module(module), name)


def functional_class():
    """The class `kg.KeepGradModel(inputs, outputs)` returns."""
    cls = getattr(kg.model, "FunctionalKeepGradModel", None)
    if cls is not None:
        return cls
    inputs = keras.Input((1,))
    return type(kg.KeepGradModel(inputs, keras.layers.Identity()(inputs)))


@keras.saving.register_keras_serializable(package="keras_suite")
class KeepGradSequential(kg.KeepGradModel, Sequential):
    """A `Sequential` whose training is `KeepGradModel`'s."""


# Legacy `.h5` files name a model by its bare class name, as for the
# package's own model classes.
keras.saving.get_custom_objects().setdefault("KeepGradSequential", KeepGradSequential)


class KeepGradTrainer(kg.KeepGradModel):
    """trainer_test.py's `Trainer`, mixed in after a layer class.

    trainer_test.py builds models as `class M(Trainer, layers.Dense)` with
    `layers.Dense.__init__(self, ...)` then `Trainer.__init__(self)`. The
    kept copy writes `class M(layers.Dense, Trainer)`: `Model`'s own `call`
    and config methods, which a `KeepGradModel` brings, would otherwise hide
    the layer's. Then:

    - the layer's `super().__init__(...)` reaches this class first, and goes
      on as it would in plain Keras, to `Layer.__init__`;
    - `Trainer.__init__(self)` runs `KeepGradModel.__init__` without
      initialising the layer a second time.
    """

    def __init__(self, *args, **kwargs):
        if "_dtype_policy" not in vars(self):  # the layer's own chain
            Layer.__init__(self, *args, **kwargs)
            return
        layer_init = Layer.__init__
        Layer.__init__ = _initialised_already
        try:
            super().__init__(*args, **kwargs)
        finally:
            Layer.__init__ = layer_init


def _initialised_already(self, *args, **kwargs):
    del self, args, kwargs


class _View(types.ModuleType):
    """A module whose names are `module`'s, except `overrides`."""

    def __init__(self, module, overrides):
        super().__init__(module.__name__, module.__doc__)
        self.__dict__.update(overrides)
        self.__dict__["_keras_suite_module"] = module

    def __getattr__(self, name):
        return getattr(self.__dict__["_keras_suite_module"], name)


def _replacements():
    functional = functional_class()
    classes = {
        Model: kg.KeepGradModel,
        Functional: functional,
        Sequential: KeepGradSequential,
        backend_trainer(): KeepGradTrainer,
    }
    models_overrides = {"Model": kg.KeepGradModel, "Sequential": KeepGradSequential}
    public_models = _View(keras.models, models_overrides)
    modules = {
        keras: _View(keras, {**models_overrides, "models": public_models}),
        keras.models: public_models,
        src_models: _View(src_models, {**models_overrides, "Functional": functional}),
    }
    return {id(old): new for old, new in {**classes, **modules}.items()}


def substitute(namespace, keep=()):
    """Rebinds, in a test module's `namespace`, Keras's model names.

    Args:
        namespace: Dict. A module's globals.
        keep: Names to leave as they are.

    Returns:
        The sorted names rebound.
    """
    replacements = _replacements()
    rebound = []
    for name, value in list(namespace.items()):
        if name.startswith("__") or name in keep:
            continue
        new = replacements.get(id(value))
        if new is not None:
            namespace[name] = new
            rebound.append(name)
    return sorted(rebound)
