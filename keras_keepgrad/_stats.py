"""Per-step gradient statistics, computed once inside the training step.

The callbacks and the norm metrics all need the same few numbers per step:
each variable's sum of squared gradient entries, from which come the layer
norms, the global norm and which layers hold a NaN or an infinity. They
are computed here once per step, inside the compiled step where the
gradients already are, and shared:

- the gradient metrics of the same step reuse them (`shared_squares`);
- a callback that asked for them (`require`, from its `set_model`) reads
  them between steps as one small vector (`read`), instead of every
  gradient.

On TensorFlow the training step calls `record` once, with the
`{path: kept gradient}` it just stored; the values live in a variable. On
JAX and PyTorch, whose steps are counted in Python around them, the step
computes the same sums (`shared_squares` of `keras_keepgrad._ops`: on JAX
an extra output of the jitted step, on PyTorch the tensor the gradient
metrics of the step already computed) and the keeper hands the resulting
array, still on its device, to `store` after the step. Either way
`read` returns the same `(count, paths, squares)`, with one transfer per
recorded step, and never computes anything. When no callback asked
(`requested`), the step computes nothing for them.

In the step the sums are float32 only, with no conditional (a conditional
costs more than the sums on a small model): a sum that overflows float32
reads inf like a gradient holding inf. Readers that must tell them apart
look again where a value is not finite, which is rare: the callbacks sum
the slots in float64 (`GradientNorms`), `NonFiniteGradients` checks the
entries.

Layers are variable paths minus their last component (`layer_of`), for the
metrics and the callbacks alike; `GradientNorms` turns the sums into the
layer norms, the global norm and the non-finite layers.

The vector lives in a plain `tf.Variable` held by a `_Holder` on the model,
not tracked by Keras nor `tf.train.Checkpoint` (as the gradient slots are):
never in `model.weights`, checkpoints or saved files.
"""

import threading
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_keepgrad._paths import layer_of

__all__ = [
    "GradientNorms",
    "StepNorms",
    "count",
    "layer_of",
    "read",
    "record",
    "require",
    "requested",
    "store",
    "shared_squares",
    "sum_squares",
]

_ATTRIBUTE = "_kg_step_statistics"


def _squares(grad, dtype):
    # `l2_loss` (sum of squares / 2) is one fused kernel, no squared copy.
    if isinstance(grad, tf.IndexedSlices):
        # Duplicate rows add up before squaring, as in the dense gradient.
        grad = tf.math.unsorted_segment_sum(
            grad.values, grad.indices, num_segments=grad.dense_shape[0]
        )
    return 2.0 * tf.nn.l2_loss(tf.cast(grad, dtype))


def sum_squares(grads, exact=True):
    """float64 `[len(grads)]`: each gradient's sum of squares.

    Args:
        grads: List of gradients (dense tensors or `tf.IndexedSlices`).
        exact: Bool. With False, the float32 sums only (no conditional in
            the step): a sum that overflows float32 (a norm above ~1.8e19)
            reads inf, like a gradient holding inf. A reader that must tell
            them apart sums again when a value is not finite.
    """
    if not grads:
        return tf.zeros((0,), tf.float64)
    fast = tf.stack(
        [
            tf.cast(_squares(g, tf.float64 if g.dtype == tf.float64 else tf.float32), tf.float64)
            for g in grads
        ]
    )
    if not exact:
        return fast
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(fast)),
        lambda: fast,
        lambda: tf.stack([_squares(g, tf.float64) for g in grads]),
    )


# Norms from the sums ---------------------------------------------------------


@tf.function(autograph=False)
def _sum_squares(grads):
    """float64 `[len(grads)]`: each gradient's sum of squares, exactly.

    `sum_squares` with its float64 pass, for reading the slots between
    steps. One dispatch for all variables (per-variable eager
    ops would cost more than the reductions), module-level so that every
    callback on the same model reuses one trace; `GradientNorms` calls its
    concrete function, which skips the argument matching of each
    `tf.function` call.
    """
    return sum_squares(list(grads))


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
        if tensors:
            if self._concrete is None:
                # Variables keep their shapes: one signature per instance.
                self._concrete = _sum_squares.get_concrete_function(tensors)
            squares = self._concrete(tensors).numpy()
        else:
            squares = np.zeros((0,), np.float64)
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


# Sharing within a step -------------------------------------------------------

_latest = threading.local()


def _same(refs, tensors):
    return len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors))


def shared_squares(grads_by_path):
    """`sum_squares(..., exact=False)` of the gradients, computed once.

    Within one step (one trace, or one eager step), every caller with the
    same gradient tensors gets the same tensor: `record` and each gradient
    metric share one computation. Tensors are matched by identity, so a
    step whose gradients differ (another trace, all-reduced copies) never
    gets another step's values; a tensor that no longer exists matches
    nothing.
    """
    tensors = tuple(grads_by_path.values())
    latest = getattr(_latest, "value", None)
    if latest is not None and _same(latest[0], tensors):
        squares = latest[1]()
        if squares is not None:
            return squares
    squares = sum_squares(list(tensors), exact=False)
    # Weak references: the cache keeps no step's gradients (nor a traced
    # graph) alive.
    _latest.value = ([weakref.ref(t) for t in tensors], weakref.ref(squares))
    return squares


# Between steps: the holder ---------------------------------------------------


class _Holder:
    """The last recorded step's statistics, for one model.

    Attributes:
        requested: Bool. A callback asked for the statistics.
        paths: Tuple of the variable paths of the last trace of `record`
            (TensorFlow) or of the last `store` (JAX, PyTorch).
        values: float64 `tf.Variable` `[len(paths) + 1]`: each variable's
            sum of squares, then the number of steps recorded (TensorFlow).
        squares: The last stored step's float32 sums, on their device, in
            the order of `source_paths` (JAX, PyTorch).
        stored: Int. The number of steps stored (JAX, PyTorch).
    """

    def __init__(self):
        self.requested = False
        self.paths = None
        self.values = None
        self.squares = None
        self.source_paths = None
        self.order = None  # `paths` as indices into `source_paths`, if they differ
        self.stored = 0
        self.cache = None  # (logs, what `read` returned for them)


def _holder(model, create=False):
    holder = model.__dict__.get(_ATTRIBUTE)
    if holder is None and create:
        holder = _Holder()
        # Past Keras's attribute tracking: a plain object, never saved.
        object.__setattr__(model, _ATTRIBUTE, holder)
    return holder


def require(model):
    """Asks `model`'s training step to record the statistics.

    For callbacks, from `set_model`: Keras's `fit` calls it before it makes
    the training function. A training function made without the
    statistics is dropped, so `fit` makes a new one that records them.
    """
    holder = _holder(model, create=True)
    if not holder.requested:
        holder.requested = True
        if getattr(model, "train_function", None) is not None:
            model.train_function = None


def requested(model):
    """Whether a callback asked `model`'s training step for the statistics."""
    holder = _holder(model)
    return holder is not None and holder.requested


def store(model, paths, squares, source_paths=None):
    """Stores one step's statistics, after it ran (JAX, PyTorch).

    The keepers whose steps are counted in Python call it after each step
    that wrote the slots, when a callback asked (`requested`): the
    statistics always describe the step the slots hold. Nothing is read
    here: `squares` stays on its device until a callback reads it.

    Args:
        model: The model being trained.
        paths: The kept variable paths, in `model.trainable_variables`
            order (the keys of `model.get_gradients_by_path()`).
        squares: float32 array or tensor: each variable's sum of squares,
            computed inside the step (`shared_squares` of `_ops`).
        source_paths: The paths `squares` follows, if not `paths` (the
            order in which the step kept them, which the gradient metrics
            share the sums in).
    """
    holder = _holder(model, create=True)
    paths = tuple(paths)
    source_paths = paths if source_paths is None else tuple(source_paths)
    if source_paths != holder.source_paths or paths != holder.paths:
        index = {path: i for i, path in enumerate(source_paths)}
        order = [index[path] for path in paths]
        holder.order = None if order == list(range(len(source_paths))) else np.array(order)
        holder.source_paths, holder.paths = source_paths, paths
    holder.squares = squares
    holder.stored += 1
    holder.cache = None


def record(model, grads_by_path, reduced=True, wrote=None):
    """Records this step's statistics for the callbacks; inside the step.

    The one call the training step makes, right after it stored the kept
    gradients: with the same `{path: kept gradient}`, once per training
    step. Adds no op unless a callback asked (`require`).

    Args:
        model: The model being trained.
        grads_by_path: Dict `{variable path: kept gradient}`, in
            `model.trainable_variables` order.
        reduced: Bool. Whether under a `tf.distribute` strategy the
            gradients are already the global ones. Partial (per-replica)
            gradients are not recorded: callbacks then read the slots.
        wrote: None if the slots were written this step, else a bool tensor
            saying whether they were (`keep_every > 1`): the statistics
            always describe the step the slots hold.
    """
    holder = _holder(model)
    if holder is None or not holder.requested:
        return
    context = tf.distribute.get_replica_context()
    if not reduced and context is not None and context.num_replicas_in_sync > 1:
        return
    paths = tuple(grads_by_path)
    if holder.values is None or holder.paths != paths:
        _create_values(holder, paths, model.distribute_strategy)

    def write():
        # Inside a `tf.cond` branch (`wrote`), a tensor cannot be shared
        # with ops outside it.
        squares = (
            shared_squares(grads_by_path)
            if wrote is None
            else sum_squares(list(grads_by_path.values()), exact=False)
        )
        count = holder.values[len(paths)] + 1.0
        holder.values.assign(tf.concat([squares, count[None]], 0), read_value=False)
        return tf.constant(True)

    if wrote is None:
        write()
    elif tf.executing_eagerly():
        if bool(wrote):
            write()
    else:
        tf.cond(wrote, write, lambda: tf.constant(False))


def _create_values(holder, paths, strategy):
    def create(*_):
        with tf.init_scope(), strategy.scope():
            holder.values = tf.Variable(
                tf.zeros((len(paths) + 1,), tf.float64),
                name="kept_gradient/statistics",
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        holder.paths = paths

    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None:
        # In a replica's step: a strategy creates variables only in its
        # cross-replica context, once for all replicas.
        context.merge_call(create)
    else:
        create()


def read(model, logs=None):
    """The last recorded step's statistics, between steps.

    Args:
        model: The model.
        logs: The `logs` dict of the `on_train_batch_end` call, or None.
            Keras hands the same dict to every callback of one batch and a
            new one each batch: callbacks that pass it share one read. The
            dict is held until the next read, so its identity cannot be
            reused by another batch's meanwhile.

    Returns:
        `(count, paths, squares)`: how many steps were recorded so far (a
        caller compares it with the count it saw last, to tell whether
        these describe a new step), the variable paths, and their float64
        sums of squares as a NumPy array. None when nothing was recorded
        (no callback asked, or the step does not record).
    """
    holder = _holder(model)
    if holder is None or (holder.values is None and holder.squares is None):
        return None
    cached = holder.cache
    if logs is not None and cached is not None and cached[0] is logs:
        return cached[1]
    if holder.values is None:
        # One transfer of the small vector the step computed.
        squares = np.asarray(keras.ops.convert_to_numpy(holder.squares), np.float64)
        if holder.order is not None:
            squares = squares[holder.order]
        found = holder.stored, holder.paths, squares
    else:
        strategy = model.distribute_strategy
        values = strategy.experimental_local_results(holder.values)[0].numpy()
        found = int(values[-1]), holder.paths, values[:-1]
    holder.cache = None if logs is None else (logs, found)
    return found


def count(model):
    """The number of steps recorded so far (0 when none)."""
    holder = _holder(model)
    if holder is not None and holder.values is None:
        return holder.stored  # counted in Python: nothing to read
    found = read(model)
    return 0 if found is None else found[0]
