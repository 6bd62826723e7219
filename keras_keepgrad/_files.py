"""Writing `.npz` files atomically: `GradientSnapshot`'s and the saved bad
batches of `skip_bad_steps` alike."""

import os
import uuid

import numpy as np

__all__ = ["TAG_LENGTH", "TEMPORARY", "atomic_savez"]

# `atomic_savez`'s temporary: `.<file name>.<12 hex digits>.tmp`.
TEMPORARY = ".{name}.{tag}.tmp"
TAG_LENGTH = 12


def atomic_savez(filename, arrays):
    """`np.savez` to a temporary file beside `filename`, then rename."""
    directory = os.path.dirname(os.path.abspath(filename))
    os.makedirs(directory, exist_ok=True)
    name = TEMPORARY.format(name=os.path.basename(filename), tag=uuid.uuid4().hex[:TAG_LENGTH])
    temporary = os.path.join(directory, name)
    # `os.open` with 0o666 (not `mkstemp`'s 0o600): the final file gets the
    # permissions a plain `np.savez` would give it.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, filename)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
