"""`model.first_bad_replica`: whose share of the batch went bad first.

Backend-neutral reading of what the keeper recorded. Under a
`tf.distribute` strategy with several replicas, each replica's step noted
whether its own partial gradients held a NaN or an infinity, before the
all-reduce mixed them (`backend/tensorflow/replicas.py`). On one replica
the kept gradients themselves say it. Under `keras.distribution` on JAX
the devices' partial gradients are summed inside XLA's compiled gradient
and never exist as arrays; under `DataParallel`, in a model that judges
its steps (`skip_bad_steps`) with Keras's own step, a step whose kept
gradients are not finite replays each device's rows alone
(`backend/jax_replay.py`), and those replays are the record. A step whose
global gradient is finite had no bad device (a NaN or an infinity on one
device would have reached the sum).
"""

import keras
import numpy as np

__all__ = [
    "first_bad_replica",
    "first_of",
    "note",
    "one_replica_first_bad",
    "replay_refused",
    "replica_count",
]


def replica_count(model):
    """Int. How many replicas (or devices) share each global batch."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None and keras.backend.backend() == "tensorflow":
        return int(strategy.num_replicas_in_sync)
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(np.size(distribution.device_mesh.devices))


def _finite(keeper):
    return all(
        bool(np.all(np.isfinite(keras.ops.convert_to_numpy(g)))) for g in keeper.read().values()
    )


def first_bad_replica(model, keeper):
    """As `KeepGradModel.first_bad_replica`, from `model`'s checked keeper."""
    flags = keeper.replica_flags()
    if flags is not None:
        found = np.flatnonzero(flags)
        return int(found[0]) if found.size else None
    if _finite(keeper):
        return None
    count = replica_count(model)
    if count == 1:
        return 0
    raise RuntimeError(
        f"The kept gradients of model {model.name!r} hold a NaN or an "
        f"infinity, and its batches are shared by {count} devices under "
        f"{type(keras.distribution.distribution()).__name__}, which sums "
        "their partial gradients inside the compiled gradient: they never "
        f"exist apart. {_why_not_replayed(model, keeper)} To find it, save "
        "the batch (`SkipBadSteps(save_batches_to=...)`) and "
        "`kg.replay_batch` each device's share of it on one device."
    )


def _why_not_replayed(model, keeper):
    """Why the step did not replay each device's rows (`backend/jax_replay.py`)."""
    error = getattr(keeper, "replay_error", None)
    return replay_refused(model) or (
        "The model could not run on one device's rows alone, so the step "
        f"does not replay them ({type(error).__name__}: {error})."
    )


def replay_refused(model):
    """Why a JAX step of `model` does not replay each device's rows
    (`backend/jax_replay.py`), or None where it does: under `DataParallel`,
    where the model judges its steps, with Keras's own step."""
    if not isinstance(keras.distribution.distribution(), keras.distribution.DataParallel):
        return "Only under `DataParallel` does the step replay each device's rows."
    if getattr(type(model).train_step, "_own_step", False):
        return (
            "The step replays each device's rows only with Keras's own "
            "`train_step`, whose loss it recomputes; this model has its own."
        )
    if model._skip_config is None:
        return (
            "The step replays each device's rows only where the model "
            "judges its steps: set `skip_bad_steps` (`kg.SkipBadSteps(skip="
            "False)` only flags bad steps, and trains as without it)."
        )
    return None


def note(model):
    """The monitor's words for where non-finite gradients began: `""` on
    one replica or where it cannot be told, else e.g.
    `", first on replica 1 of 2"`."""
    count = replica_count(model)
    if count == 1:
        return ""
    try:
        first = model.first_bad_replica
    except RuntimeError:
        return ""
    if first is None:
        return f", in the sum of {count} replicas whose own gradients were finite"
    return f", first on replica {first} of {count}"


def first_of(flags):
    """In a step: int32 tensor, the index of the first true of `flags` (a
    bool tensor per device), -1 if none; None where `flags` is None."""
    if flags is None:
        return None
    flags = keras.ops.convert_to_tensor(flags)
    first = keras.ops.argmax(keras.ops.cast(flags, "int32"))
    return keras.ops.where(keras.ops.any(flags), keras.ops.cast(first, "int32"), -1)


def one_replica_first_bad(model, finite):
    """In a step on one replica: int32 tensor, 0 where `finite` (whether the
    step's kept gradients were finite) is false, else -1; None (not
    known) where several replicas or devices share the batch."""
    if finite is None or replica_count(model) != 1:
        return None
    return keras.ops.where(finite, -1, 0)
