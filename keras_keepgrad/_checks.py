"""Argument checks shared by the public classes, with Keras-style messages."""

import numbers
import os
import tempfile

import keras
import numpy as np

__all__ = [
    "check_bool",
    "check_frequency",
    "check_keep_every",
    "check_non_negative_int",
    "check_positive_float",
    "check_positive_int",
    "check_unique_paths",
    "check_writable_dir",
    "nothing_kept_message",
    "require_kept_gradients",
    "shared_paths_message",
    "stale_gradients_message",
]


def check_bool(name, value):
    """Returns `value` if it is a bool; else a `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a bool (True or False). Received: "
            f"{name}={value!r} of type {type(value).__name__}"
        )
    return value


def check_keep_every(value):
    """Returns `value` as an int if it is a positive int; else a `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            "`keep_every` must be a positive int (1 keeps every step). "
            f"Received: keep_every={value!r}"
        )
    return int(value)


def check_frequency(name, value, allow_epoch=True, allow_batch=True):
    """Validates an `update_freq`-like argument; returns 'epoch' or an int."""
    if allow_batch and value == "batch":
        return 1
    if allow_epoch and value == "epoch":
        return "epoch"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    words = []
    if allow_epoch:
        words.append("'epoch'")
    if allow_batch:
        words.append("'batch'")
    words.append("a positive int")
    expected = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")


def check_positive_int(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")


def check_non_negative_int(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(
        f"`{name}` must be a non-negative int (0 disables it). Received: {name}={value!r}"
    )


def check_positive_float(name, value, above=0.0, or_none=True):
    if value is None and or_none:
        return None
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and np.isfinite(value)
        and value > above
    ):
        return float(value)
    none = " or None (off)" if or_none else ""
    raise ValueError(
        f"`{name}` must be a finite number above {above:g}{none}. Received: {name}={value!r}"
    )


def check_writable_dir(directory, name, value):
    """Creates `directory` and checks that a file can be written there.

    Raises:
        ValueError: The directory cannot be created or written to.
    """
    if "://" in directory:
        # Remote file systems (gs://, s3://): TensorFlow's own writer reports.
        return
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise ValueError(
            f"`{name}` must be a path this process can write to. Received: "
            f"{name}={value!r}, but {directory!r} cannot be written ({reason}). "
            "Pass a writable directory."
        ) from error


def require_kept_gradients(model, who):
    """Raises unless `model` keeps gradients that its training function
    keeps up to date (before training starts)."""
    if not hasattr(model, "get_gradients_by_path"):
        raise TypeError(
            f"{who} needs a model that keeps gradients. Received: a model of "
            f"type {type(model).__name__}. Build it with "
            "`keras_keepgrad.KeepGradModel(...)` or wrap it with "
            "`keras_keepgrad.keep_gradients(model)`."
        )
    if not model.keep_gradients:
        raise ValueError(
            f"{who} reads the kept gradients, but model {model.name!r} was "
            "built with `keep_gradients=False`. Set "
            "`model.keep_gradients = True` before `fit`."
        )
    # A training function kept from before a layer was frozen or unfrozen
    # keeps the old set (TensorFlow) or refuses to run (JAX): say so now,
    # not after its first step. A PyTorch step follows the change.
    if keras.backend.backend() != "torch" and model.train_function is not None:
        stale = stale_gradients_message(model)
        if stale is not None:
            raise RuntimeError(f"{who} cannot read the kept gradients. {stale}")


def stale_gradients_message(model):
    """Why `model`'s kept gradients are stale, or None if they are not.

    They are stale when the trainable variables changed (a layer frozen or
    unfrozen) since the training function that keeps them was built. The
    fix named depends on the backend's `Trainer` (`_stale_fix`).
    """
    keeper = model._keeper
    if keeper is None or keeper.trainable_paths is None:
        return None
    current = tuple(v.path for v in model.trainable_variables)
    if current == keeper.trainable_paths:
        return None
    added = sorted(set(current) - set(keeper.trainable_paths))
    removed = sorted(set(keeper.trainable_paths) - set(current))
    return (
        "The kept gradients are stale: the trainable variables changed "
        "since the training function was built (now trainable: "
        f"{added}; no longer trainable: {removed}). Call "
        f"`model.compile(...)` again{model._stale_fix}, and train."
    )


def check_unique_paths(model, variables, owners=None):
    """Raises if distinct variables among `variables` share a path.

    Kept gradients are keyed by path: of two variables with one path, one
    gradient would be lost. The same variable twice (handed to two
    optimizers) is no conflict: the later gradient is kept.

    Args:
        model: The model whose step it is, for the message.
        variables: The variables to check.
        owners: `{path: variable}` of variables already checked, which
            `variables` must not conflict with either; updated with them.
    """
    owners = {} if owners is None else owners
    shared = set()
    for variable in variables:
        if owners.setdefault(variable.path, variable) is not variable:
            shared.add(variable.path)
    if shared:
        raise ValueError(shared_paths_message(model, sorted(shared)))


def shared_paths_message(model, paths):
    """Says that distinct variables share `paths`, and how to fix it."""
    return (
        "Kept gradients are keyed by variable path, and distinct trainable "
        f"variables in the training step of model {model.name!r} share the "
        f"path{'s' if len(paths) > 1 else ''} "
        f"{', '.join(repr(p) for p in paths)}: one of their gradients would "
        "be lost. Give the layers that hold them distinct `name`s (a "
        "variable's path is its layer's name then its own, as in "
        "'dense/kernel', inside the name of the model that built the layer, "
        "if any), or build the model with "
        "`keep_gradients=False`."
    )


def nothing_kept_message(model):
    """Says that `model`'s training step kept nothing, and how to fix it."""
    return (
        f"The training step of model {model.name!r} passed no gradients to "
        "an optimizer, so no gradients were kept (the slots would only hold "
        "placeholders). Update the variables with `optimizer.apply(grads, "
        "variables)` or `optimizer.apply_gradients(...)` in `train_step`, "
        "or, to update them by hand, pass the gradients through "
        "`self.keep_step_gradients(grads, variables)` first."
    )
