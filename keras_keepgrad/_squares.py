"""Sums of squared gradient entries: the one place they are computed.

The norm metrics, the training-dynamics metrics and the callbacks all need
the same numbers: each variable's sum of squared gradient entries, and
from them the sums of a layer, of a group of variables or of all of them.
They are computed here, for every backend:

- inside the training step, once per step (`shared_squares`): every
  metric of the step and the step's record for the callbacks
  (`keras_keepgrad._stats`) share one computation;
- grouped by layer (`layer_squares`) or by any grouping of the variables
  (`group_squares`), from those per-variable sums;
- over a list of tensors at once (`total_squares`), where no step's sums
  apply (a weight update, a window of accumulated gradients);
- between steps, from the kept gradients (`GradientNorms`), into the layer
  norms, the global norm and the layers holding a NaN or an infinity.

The arithmetic is written once, with TensorFlow's function names: on JAX
and PyTorch `tf` is `_ops.tf_ops`, the same functions in `keras.ops`, and
TensorFlow is not imported. Where a backend has a faster kernel for a
sum of squares, it is used, for cost (see `_float32_sums`); the numbers
of each backend are those it always gave.

In the step the sums are float32 only, with no conditional (a conditional
costs more than the sums on a small model): a sum that overflows float32
reads inf like a gradient holding inf. Readers that must tell them apart
look again where a value is not finite, which is rare: `GradientNorms`
sums in float64, `NonFiniteGradients` checks the entries.
"""

import threading
import weakref

import keras
import numpy as np
from keras import ops

from keras_keepgrad import _compat
from keras_keepgrad._paths import layer_of

if _compat.BACKEND == "tensorflow":
    import tensorflow as tf
else:
    from keras_keepgrad._ops import tf_ops as tf

__all__ = [
    "GradientNorms",
    "StepNorms",
    "entries_finite",
    "group_squares",
    "layer_of",
    "layer_squares",
    "shared_finite",
    "shared_squares",
    "sum_squares",
    "total_squares",
]

_TENSORFLOW = _compat.BACKEND == "tensorflow"


# One tensor's, one list's -----------------------------------------------------


def _half(grad, dtype):
    # TensorFlow: `l2_loss` (sum of squares / 2) is one fused kernel, no
    # squared copy: about 2.5x faster on CPU than `reduce_sum(square(t))`.
    if isinstance(grad, tf.IndexedSlices):
        # Duplicate rows add up before squaring, as in the dense gradient.
        grad = tf.math.unsorted_segment_sum(
            grad.values, grad.indices, num_segments=grad.dense_shape[0]
        )
    return tf.nn.l2_loss(tf.cast(grad, dtype))


def sum_squares(grads, exact=True):
    """float64 `[len(grads)]`: each gradient's sum of squares (TensorFlow).

    Args:
        grads: List of gradients (dense tensors or `tf.IndexedSlices`).
        exact: Bool. With False, the float32 sums only (no conditional in
            the step): a sum that overflows float32 (a norm above ~1.8e19)
            reads inf, like a gradient holding inf. A reader that must tell
            them apart sums again when a value is not finite.
    """
    if not grads:
        return tf.zeros((0,), tf.float64)
    fast = _stacked(_halves(grads))
    if not exact:
        return fast
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(fast)),
        lambda: fast,
        lambda: tf.stack([2.0 * _half(g, tf.float64) for g in grads]),
    )


def _float32_sums(grads):
    """float32 `[len(grads)]`: each gradient's sum of squares (JAX, PyTorch)."""
    if _compat.BACKEND == "torch":
        # PyTorch runs each op as it comes: `dot(g, g)` is one fused kernel
        # per gradient, with no squared copy (on a 1M-parameter MLP on CPU
        # about 10x faster than `sum(square(g))`). `_foreach_norm` is faster
        # still, but squaring a float32 norm does not give the sum back
        # exactly.
        import torch

        flat = [ops.cast(g, "float32").reshape(-1) for g in grads]
        return torch.stack([torch.dot(g, g) for g in flat])
    # Under `jit`, XLA fuses each square into its sum.
    return ops.stack([ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads])


def total_squares(tensors):
    """The sum of squared entries over all of `tensors` (one scalar).

    For the values no step's per-variable sums give: a weight update, the
    gradients summed over a window of steps, a replica's partial gradient.
    """
    return 2.0 * tf.add_n([tf.nn.l2_loss(t) for t in tensors])


# Within a step ---------------------------------------------------------------

_latest = threading.local()


def shared_squares(grads_by_path):
    """Each gradient's sum of squares, computed once per step.

    float32 sums (on TensorFlow cast to float64, as `sum_squares(...,
    exact=False)`), in the order of `grads_by_path`. Within one step every
    caller with the same gradient tensors gets the same tensor: the
    statistics recorded for the callbacks and each gradient metric share
    one computation. Tensors are matched by identity, so a step whose
    gradients differ (another trace, all-reduced copies) never gets another
    step's values; a tensor that no longer exists matches nothing. On JAX
    the jitted step computes a repeated sum once anyway (XLA's common
    subexpressions), so nothing is matched.
    """
    tensors = tuple(grads_by_path.values())
    if not tensors and not _TENSORFLOW:
        return ops.zeros((0,), "float32")
    if _compat.BACKEND == "jax":
        return _float32_sums(tensors)
    latest = getattr(_latest, "value", None)
    if latest is not None and len(latest[0]) == len(tensors):
        if all(ref() is t for ref, t in zip(latest[0], tensors)):
            squares = latest[1]()
            if squares is not None:
                return squares
    halves = None
    if _TENSORFLOW:
        halves = _halves(tensors)
        squares = _stacked(halves) if halves else tf.zeros((0,), tf.float64)
        # Weakly held: the cache keeps no traced graph alive.
        held = weakref.ref(squares)
    else:
        # PyTorch's keeper asks after the step, when the metrics that
        # computed the sums have let go of them: held until the next step.
        squares = _float32_sums(tensors)
        held = lambda: squares  # noqa: E731
    # The gradients weakly: the cache keeps no step's gradients alive.
    halves = None if halves is None else [weakref.ref(h) for h in halves]
    _latest.value = ([weakref.ref(t) for t in tensors], held, halves)
    return squares


def _halves(grads):
    """Each gradient's `l2_loss` (half its sum of squares): float32, or
    float64 for a float64 gradient."""
    return [_half(g, tf.float64 if g.dtype == tf.float64 else tf.float32) for g in grads]


def _stacked(halves):
    return tf.stack([tf.cast(2.0 * h, tf.float64) for h in halves])


def shared_finite(grads_by_path):
    """Bool scalar: whether the step's sums of squares (`shared_squares`)
    add up finite. Where not, a gradient holds a NaN or an infinity, or a
    float32 sum overflowed: readers look at the entries then.

    On TensorFlow the sum of the `l2_loss`es themselves, which the step's
    gradient metrics share: fewer ops before it than the stacked float64
    sums (a skip's update waits for it).
    """
    squares = shared_squares(grads_by_path)
    halves = [h() for h in _latest.value[2]] if _TENSORFLOW else []
    if halves and all(h is not None for h in halves):
        if any(h.dtype != tf.float32 for h in halves):
            halves = [tf.cast(h, tf.float64) for h in halves]
        return tf.math.is_finite(tf.add_n(halves))
    return ops.all(ops.isfinite(squares))


def entries_finite(grads):
    """Bool scalar: whether every entry of `grads` (a list of tensors) is
    finite; true for none."""
    if not grads:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads]))


def layer_squares(grads, squares):
    """`{layer: its sum of squares}` from each variable's, in variable order.

    Args:
        grads: The `{path: gradient}` that `squares` follows.
        squares: `shared_squares(grads)`.
    """
    positions = {}
    for i, path in enumerate(grads):
        positions.setdefault(layer_of(path), []).append(i)
    return {layer: tf.add_n([squares[i] for i in indices]) for layer, indices in positions.items()}


def group_squares(grads, groups):
    """float32 `[groups]`: each group's sum of squared gradient entries.

    From the step's per-variable sums (`shared_squares`): a statistic that
    needs them adds no pass over the gradients where another asked too.

    Args:
        grads: `{path: gradient}`.
        groups: `{key: [path, ...]}`, each path of `grads` in one group.
    """
    squares = shared_squares(grads)
    if len(groups) == 1:
        return tf.cast(tf.reduce_sum(squares), tf.float32)[None]
    position = {p: i for i, p in enumerate(grads)}
    segment = [0] * len(position)
    for g, paths in enumerate(groups.values()):
        for p in paths:
            segment[position[p]] = g
    summed = tf.math.unsorted_segment_sum(squares, tf.constant(segment), len(groups))
    return tf.cast(summed, tf.float32)


# Between steps ---------------------------------------------------------------


def _tf_between_steps():
    @tf.function(autograph=False)
    def between_steps(grads):
        """`sum_squares` with its float64 pass, for reading the slots.

        One dispatch for all variables (per-variable eager ops would cost
        more than the reductions), module-level so that every callback on
        the same model reuses one trace; `GradientNorms` calls its concrete
        function, which skips the argument matching of each `tf.function`
        call.
        """
        return sum_squares(list(grads))

    return between_steps


_between_steps = _tf_between_steps() if _TENSORFLOW else None


def _numpy_sums(tensors):
    """float64 NumPy `[len(tensors)]` of the kept gradients (JAX, PyTorch):
    the step's float32 sums, in float64 where one is not finite (JAX
    computes float64 only with `jax_enable_x64`, hence NumPy)."""
    squares = np.asarray(keras.ops.convert_to_numpy(_float32_sums(tensors)), np.float64)
    for i in np.flatnonzero(~np.isfinite(squares)):
        entries = np.asarray(keras.ops.convert_to_numpy(tensors[i]), np.float64).ravel()
        squares[i] = np.dot(entries, entries)
    return squares


class StepNorms:
    """One step's L2 norms: per layer (forward order) and global.

    Attributes:
        layer_norms: float64 array, one norm per layer of
            `GradientNorms.layers`; NaN or inf where a gradient is not finite.
        global_norm: Float. The L2 norm over all kept gradients.
        layer_nonfinite: bool array, True where a layer's gradients hold a
            NaN or an infinity.
    """

    def __init__(self, layer_norms, global_norm, layer_nonfinite):
        self.layer_norms = layer_norms
        self.global_norm = global_norm
        self.layer_nonfinite = layer_nonfinite

    @property
    def nonfinite(self):
        """Bool. Whether any gradient of the step holds a NaN or an infinity."""
        return bool(self.layer_nonfinite.any())


class GradientNorms:
    """Computes per-layer and global gradient norms for fixed variables.

    Layers are the variable paths minus their last component (`layer_of`),
    in the order they first appear in `paths` (the order of
    `model.trainable_variables`, i.e. forward order).

    Args:
        paths: The variable paths, in `model.trainable_variables` order.
    """

    def __init__(self, paths):
        self.paths = tuple(paths)
        layers = {}
        for path in self.paths:
            layers.setdefault(layer_of(path), len(layers))
        self.layers = tuple(layers)
        self._layer_index = np.array([layers[layer_of(p)] for p in self.paths], dtype=np.int64)
        self._concrete = None

    def __call__(self, grads_by_path):
        """Returns the `StepNorms` of `{path: dense gradient}`."""
        tensors = [grads_by_path[p] for p in self.paths]
        if not tensors:
            squares = np.zeros((0,), np.float64)
        elif not _TENSORFLOW:
            squares = _numpy_sums(tensors)
        else:
            if self._concrete is None:
                # Variables keep their shapes: one signature per instance.
                self._concrete = _between_steps.get_concrete_function(tensors)
            squares = self._concrete(tensors).numpy()
        return self.from_squares(squares)

    def from_squares(self, squares):
        """Returns the `StepNorms` of each variable's sum of squares."""
        squares = np.asarray(squares, np.float64)
        n_layers = len(self.layers)
        with np.errstate(invalid="ignore"):
            layer_squares = np.bincount(self._layer_index, weights=squares, minlength=n_layers)
        var_nonfinite = ~np.isfinite(squares)
        layer_nonfinite = (
            np.bincount(self._layer_index, weights=var_nonfinite, minlength=n_layers) > 0
        )
        return StepNorms(
            np.sqrt(layer_squares),
            float(np.sqrt(np.sum(squares))),
            layer_nonfinite,
        )
