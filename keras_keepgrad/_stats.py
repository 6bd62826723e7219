"""Per-step gradient statistics, recorded in the step, read between steps.

The callbacks need the same few numbers per step: each variable's sum of
squared gradient entries, from which come the layer norms, the global norm
and which layers hold a NaN or an infinity. The training step computes
them (`keras_keepgrad._squares.shared_squares`, shared with the gradient
metrics of the same step) when a callback asked (`require`, from its
`set_model`), and callbacks read them between steps as one small vector
(`read`), instead of every gradient.

On TensorFlow the training step calls `record` once, with the
`{path: kept gradient}` it just stored; the values live in a variable. On
JAX and PyTorch, whose steps are counted in Python around them, the step
computes the same sums (on JAX an extra output of the jitted step, on
PyTorch the tensor the gradient metrics of the step already computed) and
the keeper hands the resulting array, still on its device, to `store`
after the step. Either way `read` returns the same `(count, paths,
squares)`, with one transfer per recorded step, and never computes
anything. When no callback asked (`requested`), the step computes nothing
for them.

The vector lives in a plain `tf.Variable` held by a `_Holder` on the model,
not tracked by Keras nor `tf.train.Checkpoint` (as the gradient slots are):
never in `model.weights`, checkpoints or saved files.
"""

import keras
import numpy as np

from keras_keepgrad import _compat
from keras_keepgrad._squares import shared_squares
from keras_keepgrad._squares import sum_squares

if _compat.BACKEND == "tensorflow":
    # `record`, in TensorFlow's training step, and the reads of its variable.
    import tensorflow as tf

__all__ = [
    "count",
    "read",
    "record",
    "require",
    "requested",
    "store",
]

_ATTRIBUTE = "_kg_step_statistics"


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
            computed inside the step (`_squares.shared_squares`).
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
        values = _read_variable(strategy.experimental_local_results(holder.values)[0])
        found = int(values[-1]), holder.paths, values[:-1]
    holder.cache = None if logs is None else (logs, found)
    return found


def _read_variable(variable):
    """A TensorFlow variable's value as a NumPy array, with one op.

    `variable.numpy()` adds an identity op and Python dispatch: about 47 us
    on these CPUs against 13, which a callback reading the statistics every
    batch pays every batch.
    """
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype).numpy()


def count(model):
    """The number of steps recorded so far (0 when none)."""
    holder = _holder(model)
    if holder is not None and holder.values is None:
        return holder.stored  # counted in Python: nothing to read
    found = read(model)
    return 0 if found is None else found[0]
