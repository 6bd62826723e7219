"""The spike rule of `skip_bad_steps` (`_skipping`), written once for two
arithmetics: Keras ops on tensors (`TENSORS`), and Python floats on the
host (`HOST`), rounded to float32 after each operation.

The host's is for PyTorch, whose step judges eagerly and reads the verdict
as a Python bool anyway: the rule is about twenty operations on scalars
and a `window` of norms, and as PyTorch operations they cost about 15 µs
each inside the 1M-parameter MLP's step on a 2-core CPU: with their reads
and writes, about 330 µs of a 10 ms step; in Python floats, about 100.
Each host result equals the float32 one: the rule adds, multiplies,
divides and takes a square root, each of float32 operands, and such an
operation computed in float64 and rounded to float32 rounds as float32
arithmetic does (float64 has more than twice float32's precision, plus
two bits).
"""

import math
import operator
import struct

import numpy as np
from keras import ops

from keras_keepgrad import _ops

__all__ = ["EMPTY", "HOST", "TENSORS", "arithmetic", "spike"]


# Where fewer than `window` norms were recorded: below every norm.
EMPTY = -1.0


def spike(a, squares, finite, norms, factor, window, row=None):
    """Whether a step (or one of its updates) spikes, in arithmetic `a`,
    and the window of norms after it.

    Its global norm is the square root of the sum of `squares` (each kept
    gradient's sum of squares). It spikes where it is above `factor` times
    the median of the last `window` finite norms (`norms`), once
    `window` of them were recorded. A finite norm joins them (that of a
    skipped spike too) where the step's gradients are all `finite`.

    The window is the one variable written: its norms oldest first, each
    step's shifted in at the end, and `EMPTY` where none was recorded yet
    (a window is full when its least entry is not `EMPTY`). A count and a
    position of its own, each written every step, measured about a point
    of the 1M-parameter MLP's TensorFlow step more.

    Args:
        a: `TENSORS` or `HOST`.
        squares: 1-D float32 tensor.
        finite: Bool tensor.
        norms: Tensor, the window as the step begins.
        factor: Float above 1.
        window: Int, the length of `norms`'s rows.
        row: None, or an int: `norms` holds a window for each of a step's
            updates (`[updates, window]`), and row `row`'s is consulted and
            updated; the others are left as they were.

    Returns:
        `(spiked, norms)`: a bool, and the window after the step, in `a`'s
        kind.
    """
    norms = a.read(norms)
    if row is not None:
        spiked, own = spike(a, squares, finite, a.row(norms, row), factor, window)
        return spiked, a.put_row(norms, row, own)
    norm = a.sqrt(a.total(squares))
    ordered = a.sort(norms)
    median = a.div(a.add(ordered[(window - 1) // 2], ordered[window // 2]), 2.0)
    spiked = a.logical_and(a.greater(ordered[0], EMPTY), a.greater(norm, a.mul(factor, median)))
    joins = a.logical_and(a.read(finite), a.isfinite(norm))
    return spiked, a.shift(norms, norm, joins)


def arithmetic():
    """`HOST` where the step's judgement runs eagerly (`_ops.on_host`),
    else `TENSORS`."""
    return HOST if _ops.on_host() else TENSORS


def _shift_tensor(norms, norm, joins):
    shifted = ops.concatenate([norms[1:], ops.reshape(norm, (1,))])
    return ops.where(joins, shifted, norms)


def _put_row_tensor(values, row, value):
    at = ops.equal(ops.arange(ops.shape(values)[0]), row)
    if len(values.shape) > 1:
        at = ops.expand_dims(at, 1)
    return ops.where(at, value, values)


class TENSORS:
    """Keras ops: traced, or eager."""

    read = staticmethod(lambda x: x)
    total = staticmethod(lambda squares: ops.cast(ops.sum(squares), "float32"))
    sqrt = staticmethod(ops.sqrt)
    sort = staticmethod(ops.sort)
    add = staticmethod(operator.add)
    mul = staticmethod(operator.mul)
    div = staticmethod(operator.truediv)
    greater = staticmethod(ops.greater)
    logical_and = staticmethod(ops.logical_and)
    logical_or = staticmethod(ops.logical_or)
    logical_not = staticmethod(ops.logical_not)
    isfinite = staticmethod(ops.isfinite)
    shift = staticmethod(_shift_tensor)
    row = staticmethod(lambda values, row: values[row])
    put_row = staticmethod(_put_row_tensor)
    count = staticmethod(lambda x: ops.cast(x, "float32"))


def _f32(x):
    """`x` rounded to the nearest float32, to infinity beyond its range: the
    native "f" format is C's conversion (the standard-size "<f" raises)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _host_list(x):
    # `tolist` where the tensor has one (PyTorch's, on any device; JAX's),
    # else NumPy's: Keras's `convert_to_numpy` cost about 60 µs in the step.
    tolist = getattr(x, "tolist", None)
    return tolist() if tolist is not None else np.asarray(x).tolist()


def _read_host(x):
    # A scalar by `float` (a bool as 0.0 or 1.0); the window as a list.
    if isinstance(x, (float, list)):
        return x  # read already (a row of a window for each update)
    return float(x) if not len(x.shape) else _host_list(x)


def _total_host(squares):
    total = 0.0
    for value in _host_list(squares):
        total = _f32(total + value)
    return total


def _shift_host(norms, norm, joins):
    # As a NumPy array, which becomes a tensor faster than a list does.
    norms = np.array(norms, "float32")
    if joins:
        norms[:-1] = norms[1:]
        norms[-1] = norm
    return norms


def _put_row_host(values, row, value):
    # A NumPy array, as `_shift_host`'s: read again by a later update's rule.
    values = np.array(values, "float32")
    values[row] = value
    return values


class HOST:
    """Python floats and bools, each arithmetic result rounded to float32
    (the sums of squares added in order); the window a list of them, and
    after its update a NumPy float32 array."""

    read = staticmethod(_read_host)
    total = staticmethod(_total_host)
    # A sum of squares is never negative: NaN is the only other operand.
    sqrt = staticmethod(lambda x: math.nan if math.isnan(x) else _f32(math.sqrt(x)))
    sort = staticmethod(sorted)
    add = staticmethod(lambda x, y: _f32(x + y))
    mul = staticmethod(lambda x, y: _f32(_f32(x) * _f32(y)))
    div = staticmethod(lambda x, y: _f32(x / y))
    greater = staticmethod(operator.gt)
    logical_and = staticmethod(lambda x, y: bool(x) and bool(y))
    logical_or = staticmethod(lambda x, y: bool(x) or bool(y))
    logical_not = staticmethod(lambda x: not bool(x))
    isfinite = staticmethod(math.isfinite)
    shift = staticmethod(_shift_host)
    row = staticmethod(lambda values, row: values[row])
    put_row = staticmethod(_put_row_host)
    count = staticmethod(lambda x: 1.0 if x else 0.0)
