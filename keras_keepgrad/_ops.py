"""The few TensorFlow functions the metrics use, in `keras.ops`; and
`cond`, `keras.ops.cond` without its per-call cost on PyTorch.

Backend-neutral: on JAX and PyTorch, the `metrics` package and `_squares`
import `tf_ops` as `tf`, so that their arithmetic is written once for every
backend. Nothing here imports TensorFlow.
"""

import contextlib
import functools

import keras
from keras import ops

from keras_keepgrad import _compat

__all__ = ["cond", "on_host", "tf_ops"]


def on_host():
    """Whether the step's bookkeeping runs eagerly, so that Python decides:
    on PyTorch (also under `torch.compile`, `_torch_compile`), outside
    Keras's symbolic tracing."""
    return _compat.BACKEND == "torch" and not _compat.in_symbolic_build()


def cond(pred, true_fn, false_fn):
    """`keras.ops.cond(pred, true_fn, false_fn)`.

    On PyTorch, outside Keras's symbolic tracing, a Python `if`, as
    Keras's own PyTorch `cond` is: `keras.ops.cond` also builds a Keras
    `Operation` on each call, about 40 µs more per call on a 2-core CPU,
    and the step's judgement and metrics call it every step.
    """
    if on_host():
        return true_fn() if bool(pred) else false_fn()
    return ops.cond(pred, true_fn, false_fn)


class _TensorFlowSubset:
    """The few TensorFlow functions the gradient metrics use, in `keras.ops`.

    Same names and semantics, so that the metrics' arithmetic is written
    once for every backend (the `metrics` package and `_squares` import
    this as `tf` off TensorFlow).
    """

    float32 = "float32"
    float64 = "float64"

    class nn:
        @staticmethod
        def l2_loss(t):
            return ops.sum(ops.square(t)) / 2.0

    class math:
        @staticmethod
        def is_finite(t):
            return ops.isfinite(t)

        @staticmethod
        def divide_no_nan(a, b):
            a, b = ops.convert_to_tensor(a), ops.convert_to_tensor(b)
            safe = ops.where(ops.equal(b, 0.0), ops.ones_like(b), b)
            return ops.where(ops.equal(b, 0.0), ops.zeros_like(a), a / safe)

        @staticmethod
        def unsorted_segment_sum(data, segment_ids, num_segments):
            return ops.segment_sum(data, segment_ids, num_segments=num_segments)

    @staticmethod
    def cast(t, dtype):
        return ops.cast(t, dtype)

    @staticmethod
    def zeros(shape):
        return ops.zeros(shape, "float32")

    @staticmethod
    def ones(shape):
        return ops.ones(shape, "float32")

    @staticmethod
    def concat(tensors, axis):
        return ops.concatenate(tensors, axis=axis)

    @staticmethod
    def equal(x, y):
        return ops.equal(x, y)

    @staticmethod
    def add_n(tensors):
        return functools.reduce(ops.add, tensors)

    @staticmethod
    def sqrt(t):
        return ops.sqrt(t)

    @staticmethod
    def constant(value, dtype=None):
        return ops.convert_to_tensor(value, dtype=dtype)

    @staticmethod
    def convert_to_tensor(value, dtype=None):
        return ops.convert_to_tensor(value, dtype=dtype)

    # `where` and `maximum` also take a metric's variable, which JAX's
    # traced step must read as its mapped value.
    @staticmethod
    def identity(t):
        # A new tensor, as `tf.identity` reads a variable's value: PyTorch
        # variables change their tensor in place.
        return ops.copy(t)

    @staticmethod
    def where(condition, x, y):
        return ops.where(condition, _value(x), _value(y))

    @staticmethod
    def maximum(x, y):
        return ops.maximum(_value(x), _value(y))

    @staticmethod
    def reduce_max(t):
        return ops.max(t)

    @staticmethod
    def reduce_all(t):
        return ops.all(t)

    @staticmethod
    def abs(t):
        return ops.abs(t)

    @staticmethod
    def stack(tensors):
        return ops.stack(tensors)

    @staticmethod
    def reduce_sum(t):
        return ops.sum(t)

    @staticmethod
    def cond(pred, true_fn, false_fn):
        return cond(pred, true_fn, false_fn)

    @staticmethod
    def executing_eagerly():
        # Only asked outside a training step, where nothing is traced.
        return True

    @staticmethod
    def init_scope():
        # Metric variables are made before the step is traced (JAX), or
        # in an eager step (PyTorch).
        return contextlib.nullcontext()


tf_ops = _TensorFlowSubset


def _value(x):
    return ops.convert_to_tensor(x) if isinstance(x, keras.Variable) else x
