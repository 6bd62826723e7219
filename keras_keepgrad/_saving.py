"""What goes into Keras's own saved files, and what never does.

Keras's saving (`model.save("x.keras")`, `model.save_weights("x.weights.h5")`,
`keras.models.load_model`, `model.load_weights`, and so the `ModelCheckpoint`
and `BackupAndRestore` callbacks) walks a model's attributes and saves the
state of every Keras saveable it finds, each in its own group of the weights
file. A `KeepGradModel` exposes one more such saveable, under the attribute
`_kept_gradients`; this module is what it writes and reads:

- By default (`save_gradients=False`), and whenever nothing was kept yet, it
  writes nothing: no group, no array. The file holds exactly the arrays of
  the equivalent `keras.Model`, so weights move between a `KeepGradModel` and
  a plain model both ways.
- With `save_gradients=True` (and `keep_gradients=True`, after training), it
  writes the last kept batch's gradients as dense arrays, with the dtype the
  optimizer received, in the group `<model group>/_kept_gradients/vars`, one
  dataset per trainable variable named by its `variable.path` with "/"
  escaped (`urllib.parse.quote(path, safe="")`: "dense/kernel" is stored as
  "dense%2Fkernel"). A plain model never visits that group, so it loads such
  a file too, ignoring the gradients.
- Loading restores saved gradients exactly, matched by variable path. They
  must cover exactly the model's trainable variables, with their shapes (and,
  where slots already exist, their dtypes); otherwise loading raises a
  `ValueError` naming the variables, and no gradient is restored. With
  `load_weights(..., skip_mismatch=True)` Keras turns that error into a
  warning and loads the weights without the gradients.
- After loading, and before any training, the restored gradients live in
  dense slots made from the saved arrays, so `model.gradients` reads them.
  The next `fit` (anything that builds the training function) replaces them
  with fresh zero slots, as for any model.

Gradient slots are plain `tf.Variable`s held outside Keras's and
TensorFlow's tracking (see `_keeper.py`), so `model.weights`,
`tf.train.Checkpoint` and `model.export()` never contain them, whatever
`save_gradients` says.
"""

import urllib.parse
import warnings
import weakref

import tensorflow as tf

# Written against Keras 3.15. `saving_lib` saves every `KerasSaveable` it
# finds among a model's attributes (`dir(model)`), and there is no public
# alias of that base class.
from keras.src.saving.keras_saveable import KerasSaveable

from keras_keepgrad import _keeper

__all__ = [
    "ATTRIBUTE",
    "KeptGradientsState",
    "gradient_key",
    "kept_gradients_state",
]

# The model attribute Keras's saving walks; also the name of the group that
# holds the gradients in the weights file.
ATTRIBUTE = "_kept_gradients"


def gradient_key(path):
    """The dataset name of a variable's gradient: its path, "/" escaped.

    Args:
        path: String. A `variable.path`, e.g. `"dense/kernel"`.

    Returns:
        The key, e.g. `"dense%2Fkernel"`; `urllib.parse.unquote` inverts it.

    Example:

    >>> gradient_key("dense/kernel")
    'dense%2Fkernel'
    """
    return urllib.parse.quote(path, safe="")


class KeptGradientsState(KerasSaveable):
    """The saveable state of one model's kept gradients.

    Keras's saving finds it through the model's `_kept_gradients` attribute
    and calls `save_own_variables` / `load_own_variables` with the model's
    `_kept_gradients` store. It holds the model weakly and no variable of
    its own, so nothing but Keras's own files sees it.

    Args:
        model: The `KeepGradModel` whose kept gradients it saves.
    """

    def __init__(self, model):
        self._model_ref = weakref.ref(model)

    def _obj_type(self):
        # Keras walks this object's attributes (none are saveables) with
        # the skip list of a plain layer.
        return "Layer"

    def __repr__(self):
        model = self._model_ref()
        name = None if model is None else model.name
        return f"<kept gradients of model {name!r}>"

    def save_own_variables(self, store):
        """Writes the kept gradients into `store`, if the model saves them.

        Args:
            store: The dict-like store Keras's saving passes.
        """
        model = self._model_ref()
        if model is None or not (model.keep_gradients and model.save_gradients):
            return
        keeper = model._keeper
        if keeper is None or not keeper.built:
            # Not trained yet: nothing kept, nothing to save.
            return
        try:
            grads = model.get_gradients_by_path()
        except RuntimeError as e:
            # Raising here would leave a half-written file in place of the
            # one being replaced: save the rest, and say so.
            warnings.warn(
                f"The kept gradients of model {model.name!r} were not saved "
                f"(`save_gradients=True`): {e}",
                stacklevel=2,
            )
            return
        for path, grad in grads.items():
            store[gradient_key(path)] = grad

    def load_own_variables(self, store):
        """Restores the gradients saved in `store`, if there are any.

        Args:
            store: The dict-like store Keras's loading passes.

        Raises:
            ValueError: The saved gradients do not match the model's
                trainable variables (paths, shapes or dtypes). Nothing is
                restored then.
        """
        keys = list(store.keys())
        model = self._model_ref()
        if not keys or model is None or not model.keep_gradients:
            return
        saved = {urllib.parse.unquote(key): store[key] for key in keys}
        variables = list(model.trainable_variables)
        _check_saved_gradients(model, variables, saved)
        keeper = model._keeper
        if keeper is None:
            keeper = model._keeper = _keeper.GradientKeeper(sparse=not model.jit_compile)
        keeper.restore(variables, saved, model.distribute_strategy)


_STATES = weakref.WeakKeyDictionary()


def kept_gradients_state(model):
    """The one `KeptGradientsState` of `model` (made on first use).

    One object per model, so Keras's saving, which remembers the saveables
    it visited by `id`, sees the same one on every visit.

    Args:
        model: A `KeepGradModel`.

    Returns:
        A `KeptGradientsState`.
    """
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = KeptGradientsState(model)
    return state


def _check_saved_gradients(model, variables, saved):
    """Raises unless `saved` ({path: array}) fits `variables` one to one."""
    fix = (
        "To load the weights without the gradients, pass "
        "`skip_mismatch=True` to `load_weights()`; or save the file from a "
        "model with `save_gradients=False`."
    )
    expected = {v.path: v for v in variables}
    missing = sorted(set(expected) - set(saved))
    unknown = sorted(set(saved) - set(expected))
    if missing or unknown:
        raise ValueError(
            "The gradients saved in the file do not match the trainable "
            f"variables of model {model.name!r}. Gradients are matched by "
            "`variable.path`, which holds the layer names. No saved gradient "
            f"for the trainable variables: {missing}. Saved gradients for "
            f"variables the model does not train: {unknown}. {fix}"
        )
    keeper = model._keeper
    slots = keeper.slot_dtypes() if keeper is not None and keeper.built else {}
    for path, variable in expected.items():
        array = saved[path]
        if tuple(array.shape) != tuple(variable.shape):
            raise ValueError(
                f"The gradient saved for variable {path!r} has shape "
                f"{tuple(array.shape)}, but the variable has shape "
                f"{tuple(variable.shape)} in model {model.name!r}. {fix}"
            )
        dtype = slots.get(path)
        if dtype is not None and tf.as_dtype(array.dtype) != dtype:
            raise ValueError(
                f"The gradient saved for variable {path!r} has dtype "
                f"{tf.as_dtype(array.dtype).name}, but model {model.name!r} "
                f"keeps it as {dtype.name} (e.g. a different dtype policy or "
                f"loss-scale optimizer). {fix}"
            )
