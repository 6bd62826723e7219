"""The evidence of a bad step: its batch saved to `.npz`, and replayed.

With `SkipBadSteps(save_batches_to=...)` the training step hands what it
received (inputs, targets, sample weights), its kept gradients, its step
number and its loss scale to `save`, on the host, only where the step was
bad (skipped, or flagged with `SkipBadSteps(skip=False)`): the backend's
`call_if` runs it under the step's own condition (a `tf.cond` around a
`tf.numpy_function`, after the XLA program on an XLA step; a
`jax.lax.cond` around a `jax.debug.callback`; a Python `if` on PyTorch),
so a good step moves nothing off the device.
"""

import glob
import os
import warnings

import keras
import numpy as np

from keras_keepgrad import _files
from keras_keepgrad import backend

__all__ = ["PREFIX", "flatten_batch", "replay_batch", "save"]

# Saved files are `<save_batches_to>/bad_step_<step, 8 digits>.npz`.
PREFIX = "bad_step_"
_PARTS = ("x", "y", "sample_weight")


def flatten_batch(data):
    """`{key: tensor}` of a step's `data`: `x`, `y`, `sample_weight`, or
    `x/<key>` for each entry of a dict, list or tuple (one level).

    Raises:
        ValueError: A part nested deeper than one level.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    flat = {}
    for name, part in zip(_PARTS, (x, y, sample_weight)):
        if part is None:
            continue
        if isinstance(part, dict):
            items = part.items()
        elif isinstance(part, (list, tuple)):
            items = ((str(i), p) for i, p in enumerate(part))
        else:
            flat[name] = part
            continue
        for key, value in items:
            if isinstance(value, (dict, list, tuple)):
                raise ValueError(
                    "`SkipBadSteps(save_batches_to=...)` saves inputs, targets "
                    "and sample weights that are tensors, or dicts, lists or "
                    f"tuples of tensors. Received a nested {name!r}: {part!r}. "
                    "Flatten it, or set `save_batches_to=None`."
                )
            flat[f"{name}/{key}"] = value
    return flat


def _unflatten(arrays, name):
    if name in arrays:
        return arrays[name]
    keys = [k[len(name) + 1 :] for k in arrays if k.startswith(name + "/")]
    if not keys:
        return None
    if all(k.isdigit() for k in keys):
        return [arrays[f"{name}/{i}"] for i in range(len(keys))]
    return {k: arrays[f"{name}/{k}"] for k in keys}


def count_saved(directory):
    return len(glob.glob(os.path.join(glob.escape(directory), PREFIX + "*.npz")))


def _free_name(directory, step):
    # A file of that name is an earlier run's (each model object counts its
    # steps from 1): kept, as the first files are; this one gets `_2`, ...
    base = os.path.join(directory, f"{PREFIX}{step:08d}")
    filename, copy = base + ".npz", 1
    while os.path.exists(filename):
        copy += 1
        filename = f"{base}_{copy}.npz"
    return filename


def save(directory, max_saved, arrays):
    """Writes `arrays` (host values; `step` among them) to a new file of
    `directory`, unless it holds `max_saved` saved batches already.

    The first `max_saved` are kept: later bad steps are usually the
    consequences of the first. A failed write is warned about; training
    goes on.
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    # Counted in float32 inside the step (exact up to 2**24 steps).
    arrays["step"] = np.int64(arrays["step"])
    if "first_bad_replica" in arrays:
        arrays["first_bad_replica"] = np.int64(arrays["first_bad_replica"])
    if "skipped" in arrays:
        arrays["skipped"] = np.bool_(arrays["skipped"])
    try:
        if count_saved(directory) >= max_saved:
            return
        _files.atomic_savez(_free_name(directory, int(arrays["step"])), arrays)
    except Exception as error:  # noqa: BLE001 - a save never stops training
        warnings.warn(
            f"`SkipBadSteps` could not save the batch of bad step "
            f"{arrays.get('step')!r} to {directory!r}: {error}",
            stacklevel=2,
        )


def replay_batch(model: keras.Model, path: str | os.PathLike) -> dict:
    """The gradients of a saved bad batch, computed again on `model`.

    Loads a file that `SkipBadSteps(save_batches_to=...)` wrote and runs
    the batch it holds through `model` as a training step computes its
    gradients (a forward pass with `training=True`, the compiled loss and
    the model's own losses, the saved `loss_scale` multiplied in and
    divided out), without an update: the weights and the optimizer are
    left as they are. On a model restored from a
    checkpoint taken before that step, the result equals the file's
    `grad/<path>` arrays, bit for bit where the step ran eagerly, else to
    float32 rounding (a compiled step may sum in another order). A
    model's own `train_step` is not replayed: its loss is the compiled one.

    Args:
        model: A compiled `KeepGradModel` (or any compiled Keras model of
            the same architecture) on any backend.
        path: Str or path of the `.npz` file.

    Returns:
        Dict `{variable path: np.ndarray}` (float32) of each trainable
        variable that has a gradient, like the file's `grad/` entries.

    Raises:
        ValueError: The file holds no saved batch, or `model` is not
            compiled.
    """
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    if "x" not in arrays and not any(k.startswith("x/") for k in arrays):
        raise ValueError(
            "`replay_batch` reads a file that `SkipBadSteps(save_batches_to=...)` "
            f"wrote. Received: path={str(path)!r}, which holds no `x` (its keys: "
            f"{sorted(arrays)}). Pass one of the `{PREFIX}*.npz` files."
        )
    if not getattr(model, "compiled", False) or getattr(model, "_compile_loss", None) is None:
        raise ValueError(
            "`replay_batch` computes the gradients with the model's compiled "
            f"loss. Received: model={model.name!r}, which is not compiled with "
            "a loss. Call `model.compile(optimizer=..., loss=...)` first."
        )
    x, y, sample_weight = (_unflatten(arrays, name) for name in _PARTS)
    scale = float(arrays["loss_scale"]) if "loss_scale" in arrays else 1.0
    x, y, sample_weight = (
        None if part is None else keras.tree.map_structure(keras.ops.convert_to_tensor, part)
        for part in (x, y, sample_weight)
    )
    grads = backend.replay_gradients(model, x, y, sample_weight, scale)
    return {
        v.path: np.asarray(keras.ops.convert_to_numpy(g), dtype="float32")
        for v, g in zip(model.trainable_variables, grads)
        if g is not None
    }
