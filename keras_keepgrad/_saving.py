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
  optimizer received, in the group `<model group>/_kept_gradients/vars`: one
  dataset per trainable variable, named `"<i>:<path>"`, where `i` is the
  variable's position in `model.trainable_variables` and `path` its
  `variable.path` with "/" escaped (`urllib.parse.quote(path, safe="")`),
  e.g. `"0:dense%2Fkernel"`. A plain model never visits that group, so it
  loads such a file too, ignoring the gradients.
- Loading restores the saved gradients exactly, matched by position, as
  Keras matches the optimizer's slot variables: a variable's path can
  change with how the model was built (a subclassed model built by `fit`
  names its kernel "net/dense/kernel", the same model built by
  `load_model` "dense/kernel"), its position does not. The saved path is
  there for people reading the file. There must be one saved gradient per
  trainable variable, with its shape (and, where slots already exist, their
  dtype); otherwise loading raises a `ValueError` naming the variables, and
  no gradient is restored. `KeepGradModel.load_weights` checks this before
  Keras loads anything (`check_gradients_in_file`), so the weights and the
  optimizer state are left as they were too. With `load_weights(...,
  skip_mismatch=True)` Keras turns that error into a warning and loads the
  weights without the gradients.
- After loading, and before any training, the restored gradients live in
  dense slots made from the saved arrays, so `model.gradients` reads them.
  The next `fit` (anything that builds the training function) replaces them
  with fresh zero slots, as for any model.

Gradient slots are plain `tf.Variable`s held outside Keras's and
TensorFlow's tracking (see `backend/tensorflow/keeper.py`), or on JAX and PyTorch plain
arrays or tensors held by the keeper (`backend/jax.py`,
`backend/torch.py`), so `model.weights`, `tf.train.Checkpoint` and
`model.export()` never contain them, whatever `save_gradients` says.
"""

import contextlib
import types
import urllib.parse
import warnings
import weakref
import zipfile

import h5py
import keras

from keras_keepgrad import _compat

__all__ = [
    "KeptGradientsState",
    "check_gradients_in_file",
    "gradient_key",
    "kept_gradients_state",
]

# Where Keras 3.15 puts the `_kept_gradients` saveable's arrays: in the
# weights HDF5 file (inside a `.keras` zip, its `model.weights.h5`), the
# group of the attribute's path under the model, then "vars".
_GROUP = "_kept_gradients/vars"
_ARCHIVE_WEIGHTS = "model.weights.h5"


def gradient_key(index, path):
    """The dataset name of a variable's saved gradient.

    Args:
        index: Int. The variable's position in `model.trainable_variables`.
        path: String. Its `variable.path`, e.g. `"dense/kernel"`.

    Returns:
        `"<index>:<path>"` with "/" escaped in the path.

    Example:

    >>> gradient_key(0, "dense/kernel")
    '0:dense%2Fkernel'
    """
    return f"{index}:{urllib.parse.quote(path, safe='')}"


def _parse_key(key):
    index, sep, path = key.partition(":")
    if not (sep and index.isdigit()):
        raise ValueError(
            f"Unexpected dataset {key!r} among the saved gradients: expected "
            "names like '0:dense%2Fkernel'. The file was not written by "
            "keras_keepgrad, or was edited."
        )
    return int(index), urllib.parse.unquote(path)


class KeptGradientsState(_compat.KerasSaveable):
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
        # Keyed by position in `model.trainable_variables`, which loading
        # matches: a step may keep only some of them.
        order = {v.path: i for i, v in enumerate(model.trainable_variables)}
        for path, grad in grads.items():
            store[gradient_key(order[path], path)] = grad

    def load_own_variables(self, store):
        """Restores the gradients saved in `store`, if there are any.

        Args:
            store: The dict-like store Keras's loading passes.

        Raises:
            ValueError: The saved gradients do not match the model's
                trainable variables (count, shapes or dtypes). Nothing
                is restored then.
        """
        keys = list(store.keys())
        model = self._model_ref()
        if not keys or model is None or not model.keep_gradients:
            return
        saved = {}
        for key in keys:
            index, path = _parse_key(key)
            saved[index] = (path, store[key])
        variables = list(model.trainable_variables)
        _check_saved_gradients(model, variables, saved)
        keeper = model._keeper
        if keeper is None:
            keeper = model._keeper = model._new_keeper()
        arrays = {v.path: saved[i][1] for i, v in enumerate(variables)}
        keeper.restore(variables, arrays, getattr(model, "distribute_strategy", None))


@contextlib.contextmanager
def _weights_file(filepath):
    """The weights HDF5 file of a `.weights.h5` or `.keras` path, else None."""
    path = str(filepath)
    if path.endswith(".weights.h5"):
        with h5py.File(path, "r") as f:
            yield f
    elif path.endswith(".keras"):
        with zipfile.ZipFile(path) as archive, archive.open(_ARCHIVE_WEIGHTS) as raw:
            with h5py.File(raw, "r") as f:
                yield f
    else:
        yield None


def check_gradients_in_file(model, filepath):
    """Raises before `load_weights` assigns anything, as loading would.

    Keras's loading catches a saveable's error, loads every other one, and
    only then raises: a mismatch in the saved gradients would leave the
    model with the file's weights and optimizer state after all. So
    `KeepGradModel.load_weights` checks the saved gradients' names, shapes
    and dtypes here first (`.weights.h5` and `.keras` files; other formats,
    sharded weights for one, are checked only while loading).

    Raises:
        ValueError: As `KeptGradientsState.load_own_variables`.
    """
    saved = {}
    try:
        with _weights_file(filepath) as f:
            group = None if f is None else f.get(_GROUP)
            for key in group or ():
                index, path = _parse_key(key)
                dataset = group[key]
                # Keras stores bfloat16 as 2-byte opaque data ("|V2"), its
                # dtype in an attribute.
                dtype = dataset.attrs.get("dtype", dataset.dtype)
                if isinstance(dtype, bytes):
                    dtype = dtype.decode()
                saved[index] = (path, types.SimpleNamespace(shape=dataset.shape, dtype=dtype))
    except (OSError, KeyError, zipfile.BadZipFile):
        return  # Keras's own loading reports an unreadable file.
    if saved:
        _check_saved_gradients(model, list(model.trainable_variables), saved)


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
    """Raises unless `saved` ({index: (path, array)}) fits `variables`."""
    fix = (
        "To load the weights without the gradients, pass "
        "`skip_mismatch=True` to `load_weights()`; or save the file from a "
        "model with `save_gradients=False`."
    )
    if sorted(saved) != list(range(len(variables))):
        saved_paths = [saved[i][0] for i in sorted(saved)]
        raise ValueError(
            f"The file holds gradients for {len(saved)} variables "
            f"({saved_paths}), but model {model.name!r} has "
            f"{len(variables)} trainable variables "
            f"({[v.path for v in variables]}). Saved gradients are matched to "
            "`model.trainable_variables` by position, so the model must "
            f"train the same variables as the one that saved them. {fix}"
        )
    keeper = model._keeper
    slots = keeper.slot_dtypes() if keeper is not None and keeper.built else {}
    for index, variable in enumerate(variables):
        saved_path, array = saved[index]
        where = (
            f"The gradient saved for variable {index} ({saved_path!r}, "
            f"loaded into {variable.path!r} of model {model.name!r})"
        )
        if tuple(array.shape) != tuple(variable.shape):
            raise ValueError(
                f"{where} has shape {tuple(array.shape)}, but the variable "
                f"has shape {tuple(variable.shape)}. {fix}"
            )
        dtype = slots.get(variable.path)
        saved_dtype = keras.backend.standardize_dtype(array.dtype)
        if dtype is not None and saved_dtype != keras.backend.standardize_dtype(dtype):
            raise ValueError(
                f"{where} has dtype {saved_dtype}, but the "
                f"model keeps it as {dtype.name} (a different dtype policy or "
                f"loss-scale optimizer?). {fix}"
            )
