"""The training-dynamics metrics' base: noise scale, SNR and step cosine.

Each compares gradients of several batches at once, which a single kept
gradient cannot give: where a `tf.distribute` strategy trains several
replicas in this process, every replica's partial gradient is one small
batch and the global gradient their mean; otherwise (one device, worker
processes, where the step all-reduces before anything is kept, and on JAX
and PyTorch, `keras.distribution` included) the last `accumulation_steps`
steps' gradients are the small batches, summed in one float32 buffer per
trainable variable.

The small-batch gradients and their batch sizes, in Keras's terms. Keras
scales each replica's loss by `1 / R` (R replicas), so that the replicas'
gradients sum to the global-batch mean gradient: replica r's partial
gradient `p_r` is `g_r / R`, where `g_r` is the mean gradient of its own
`b_r` examples, and the global gradient is `G_big = sum_r p_r = mean_r g_r`.
On one device the step's gradient `g_i` is the mean over its `b_i` examples
and `G_big = mean_i g_i` over the window of k steps. Either way, with n
small batches, their mean squared norm `S = mean_i |g_i|^2` and
`Q = |G_big|^2`, if the small batches are independent draws at the same
weights, `E[S] = |G|^2 + tr(Sigma) / B_small` and
`E[Q] = |G|^2 + tr(Sigma) / B_big`, with `B_small = 1 / mean_i(1 / b_i)` and
`B_big = n * B_small` (equal batches: `B_small = b`, `B_big = n b`).

This module holds what they share: `_DynamicsMetric` (their base, with
their state) and `_SmallBatches` (the statistics of the small batches,
for `GradientNoiseScale` and `GradientSNR`). The arithmetic is written
once: on JAX and PyTorch `tf` is `_ops.tf_ops`, the same functions in
`keras.ops` (`metrics._backend`). The state differs:
on TensorFlow it is plain `tf.Variable`s, one local copy per replica, kept
out of Keras's tracking (`Holder`); on JAX and PyTorch it is the metric's
own Keras variables (`add_variable`), which the JAX step threads through
as metrics variables, so they are made before the step is traced
(`_build_for`). Keras saves no metric's variables in its files, and
`reset_state` (`GradientMetric`'s) resets only the epoch's sums: the
window, the previous gradient and the moving averages persist.
"""

import math
import numbers

import keras

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad._squares import group_squares
from keras_keepgrad._squares import total_squares
from keras_keepgrad.metrics._backend import keeper as _keeper
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import GradientMetric
from keras_keepgrad.metrics.base import Holder
from keras_keepgrad.metrics.base import as_float32
from keras_keepgrad.metrics.base import group_by_layer
from keras_keepgrad.metrics.base import write

__all__ = [
    "DynamicsMetric",
    "SmallBatches",
    "assign",
    "assign_add",
    "create_outside_step",
    "local_variable",
    "read",
]

_TENSORFLOW = _compat.BACKEND == "tensorflow"


def local_variable(value, dtype=None):
    # One copy per replica, updated by that replica alone: every replica
    # computes the same values (from all-reduced statistics), so no copy
    # needs the others'. Out of Keras's tracking: see `Holder`.
    return tf.Variable(
        tf.cast(value, dtype or tf.float32),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def create_outside_step(fn):
    """Runs `fn` (which makes variables) outside the function being traced.

    In a replica's step of a `tf.distribute` strategy, variables are made
    once for all replicas, in its cross-replica context.
    """

    def create(strategy=None):
        with tf.init_scope():
            if strategy is None:
                return fn()
            with strategy.scope():
                return fn()

    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None:
        return context.merge_call(create)
    return create()


def read(variable):
    return tf.convert_to_tensor(variable)


def assign(variable, value):
    if _TENSORFLOW:
        variable.assign(value, read_value=False)
    else:
        write(variable, value)


def assign_add(variable, value):
    if _TENSORFLOW:
        variable.assign_add(value, read_value=False)
    else:
        # On PyTorch one pass over the window's buffer, not Keras's two.
        write(variable, value, add=True)


def _replica_context():
    """The replica context if this step's kept gradients are partial ones."""
    if not _TENSORFLOW:
        return None
    step = _capture.current_step()
    context = tf.distribute.get_replica_context()
    if step is None or step.reduced or context is None or context.num_replicas_in_sync < 2:
        return None
    return context


def _replicas_in_process():
    """Whether a step keeps each replica's partial gradient (TensorFlow's
    strategies only: under `keras.distribution` on JAX the step computes the
    global batch's gradient at once)."""
    if not _TENSORFLOW:
        return False
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync > 1 and not _keeper.reduces_in_step(strategy)


def _batch_size(y_true, y_pred):
    """The number of examples in this replica's batch, as float32."""
    for structure in (y_pred, y_true):
        for t in keras.tree.flatten(structure):
            if t is not None and getattr(t, "shape", None) is not None and len(t.shape) > 0:
                return tf.cast(keras.ops.shape(t)[0], tf.float32)
    return None


def _after_optimizer_updates():
    """Control inputs that wait for the step's optimizer updates.

    Those wait in turn for the writes of the kept gradients (`_keeper.after`).
    A buffer that took a previous step's gradient by assignment shares its
    memory with that step's slot until the slot takes this step's gradient;
    updating the buffer in place only after that avoids a copy.
    """
    variables = _keeper.current_step_variables() or {}
    return [tf.convert_to_tensor(v.value) for v in variables.values()]


def _add_to_window(sums, dense, first):
    """Adds this step's gradients to the window's sums; `first` (a bool
    tensor) starts a new window with them."""
    paths = list(dense)

    def start():
        # A window's first gradient is assigned: on TensorFlow the buffer
        # shares its memory (without XLA), where zeroing it would write it.
        for p in paths:
            assign(sums[p], dense[p])
        return tf.constant(True)

    def accumulate():
        for p in paths:
            assign_add(sums[p], dense[p])
        return tf.constant(False)

    if _compat.BACKEND == "jax":
        # The step is a pure function (also run eagerly): no branch on a
        # traced value, and an assignment is a new value anyway.
        for p in paths:
            assign(sums[p], keras.ops.where(first, dense[p], read(sums[p]) + dense[p]))
    elif tf.executing_eagerly():
        # PyTorch's step, and TensorFlow's with `run_eagerly=True`.
        (start if bool(first) else accumulate)()
    else:
        with tf.control_dependencies(_after_optimizer_updates()):
            tf.cond(first, start, accumulate)


def _check_steps(name, value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 2:
        return int(value)
    raise ValueError(
        f"`{name}` must be an int of at least 2 (the steps whose gradients "
        f"are compared). Received: {name}={value!r}"
    )


class DynamicsMetric(GradientMetric):
    """Reports NaN for an epoch in which no step gave a value.

    A step that gives none (`counted` False) adds 0, not its placeholder
    value (NaN where nothing is known yet), to the sums of `"mean"`.
    """

    def __init__(self, **kwargs):
        super().__init__(fn=None, **kwargs)
        self._counted = self.add_variable(
            shape=(), initializer="zeros", aggregation="mean", name="counted"
        )
        self._holder = Holder()

    def _zeros(self, shapes, name):
        """New float32 variables of zeros, one per shape: the metric's state.

        On TensorFlow plain local variables (`local_variable`), made
        outside the step being traced; on JAX and PyTorch the metric's own
        variables, which JAX's step must find among the metrics variables
        it was given: made before it is traced.
        """
        if _TENSORFLOW:
            return create_outside_step(lambda: [local_variable(tf.zeros(s)) for s in shapes])
        if _compat.BACKEND == "jax" and _capture.current_step() is not None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} needs state for the "
                "variables whose gradients this step keeps, which on JAX must "
                "be made before the training step is traced, from the "
                "model's trainable variables. Received: a step that keeps "
                "other variables than those it was made for, or a metric "
                "that is not compiled into the model. Compile it into the "
                "model (`compile(metrics=[...])`) and pass every trainable "
                "variable's gradient to an optimizer."
            )
        return [
            self.add_variable(
                shape=tuple(s), initializer="zeros", aggregation="only_first_replica", name=name
            )
            for s in shapes
        ]

    def _drop(self, variables):
        """Stops tracking variables of a state that was made anew."""
        if not _TENSORFLOW and variables:
            _compat.untrack_metric_variables(self, variables)

    def _parameter_state(self, paths, shapes, counters):
        """The metric's buffers, made for these variable paths and shapes.

        `{"buffers": {path: float32 variable of its shape}, "counters":
        float32 variable [groups + counters]}`, remade when the paths or
        shapes change.
        """
        state = self._holder.variables
        made_for = dict(zip(tuple(paths), (tuple(s) for s in shapes)))
        if state.get("paths") != made_for:
            size = len(self._groups(list(made_for))) + counters
            old = [*state.get("buffers", {}).values()]
            old += [state["counters"]] if "counters" in state else []
            *buffers, counter = self._zeros([*made_for.values(), (size,)], "window")
            self._drop(old)
            state.update(buffers=dict(zip(made_for, buffers)), counters=counter, paths=made_for)
        return state

    def _measure(self, grads):
        values, counted = self._counted_values(grads)
        return {k: tf.where(counted, v, 0.0) for k, v in values.items()}, counted

    def result(self):
        results = super().result()
        if not results:
            return results
        none = tf.equal(tf.convert_to_tensor(self._counted), 0.0)
        return {k: tf.where(none, tf.constant(math.nan), v) for k, v in results.items()}


class SmallBatches(DynamicsMetric):
    """Per group of variables, the statistics of the step's small batches.

    `_moments` gives, per group (one for all variables, or one per layer),
    `S` (the mean over the n small batches of their gradients' squared
    norm) and `Q` (the squared norm of their mean), with `mean(1 / b_i)`,
    n, and whether a window is complete (always, across replicas).
    """

    def __init__(self, accumulation_steps, **kwargs):
        self.accumulation_steps = _check_steps("accumulation_steps", accumulation_steps)
        self._y = (None, None)
        super().__init__(**kwargs)

    def _groups(self, paths):
        """`{log key: [path, ...]}`."""
        if getattr(self, "per_layer", False):
            groups = group_by_layer({p: p for p in paths})
            return {f"{self.name}/{layer}": ps for layer, ps in groups.items()}
        return {self.name: list(paths)}

    def update_state(self, y_true=None, y_pred=None, sample_weight=None):
        """Adds this training step's value; does nothing in evaluation.

        `y_true` and `y_pred` give the batch size (their first axis);
        `sample_weight` is ignored.
        """
        self._y = (y_true, y_pred)
        try:
            super().update_state(y_true, y_pred, sample_weight)
        finally:
            self._y = (None, None)

    def _step_batch_size(self):
        batch = _batch_size(*self._y)
        if batch is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} takes the batch size from "
                "the first axis of `y_pred` (or `y_true`). Received: "
                f"y_true={self._y[0]!r}, y_pred={self._y[1]!r}. In your own "
                "`train_step`, call `self.compute_metrics(x, y, y_pred)` or "
                "`metric.update_state(y, y_pred)`."
            )
        return batch

    # State --------------------------------------------------------------

    def _build_for(self, variables):
        super()._build_for(variables)
        if not _replicas_in_process():
            self._window_state([v.path for v in variables], [v.shape for v in variables])

    def _window_state(self, paths, shapes):
        """The accumulation window: the sum of its gradients per variable,
        and over the window so far, per group the sum of |g_i|^2, then the
        sum of 1 / b_i, then the number of steps."""
        return self._parameter_state(paths, shapes, counters=2)

    # One step -----------------------------------------------------------

    def _moments(self, grads):
        """`(S, Q, mean_inverse_batch, n, ready)`; S and Q are `[groups]`."""
        groups = self._groups(grads)
        context = _replica_context()
        if context is not None:
            return self._across_replicas(context, groups)
        return self._over_window(grads, groups)

    def _across_replicas(self, context, groups):
        replicas = float(context.num_replicas_in_sync)
        partial = _capture.current_step().grads
        # |g_r|^2 = |R p_r|^2; the global gradient is the all-reduced one.
        local = [
            replicas**2 * total_squares([as_float32(partial[p]) for p in paths])
            for paths in groups.values()
        ]
        batch = self._step_batch_size() if self._needs_batch_size else tf.constant(1.0)
        vector = tf.stack([*local, 1.0 / tf.maximum(batch, 1.0), tf.cast(batch < 1.0, tf.float32)])
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, vector)
        n_groups = len(groups)
        # The global gradient's squares, shared with the norm metrics.
        big = group_squares(_keeper.current_step_gradients(), groups)
        small = summed[:n_groups] / replicas
        inverse = summed[n_groups] / replicas
        ready = tf.equal(summed[n_groups + 1], 0.0)
        return small, big, inverse, tf.constant(replicas), ready

    def _over_window(self, grads, groups):
        paths = list(grads)
        dense = {p: as_float32(grads[p]) for p in paths}
        state = self._window_state(paths, [dense[p].shape for p in paths])
        k = float(self.accumulation_steps)
        n_groups = len(groups)
        batch = self._step_batch_size() if self._needs_batch_size else tf.constant(1.0)
        this_step = tf.concat(
            [
                group_squares(grads, groups),
                tf.stack([1.0 / tf.maximum(batch, 1.0), tf.constant(1.0)]),
            ],
            0,
        )
        before = read(state["counters"])
        totals = before + this_step
        ready = tf.equal(totals[-1], k)
        sums = state["buffers"]
        _add_to_window(sums, dense, tf.equal(before[-1], 0.0))

        def complete():
            # |mean g_i|^2 of the window, once per window.
            big = [total_squares([read(sums[p]) for p in ps]) for ps in groups.values()]
            return tf.stack(big) / (k * k)

        big = tf.cond(ready, complete, lambda: tf.zeros((n_groups,)))
        assign(state["counters"], totals * (1.0 - tf.cast(ready, tf.float32)))
        return totals[:n_groups] / k, big, totals[n_groups] / k, tf.constant(k), ready

    _needs_batch_size = True

    def get_config(self):
        config = super().get_config()
        config["accumulation_steps"] = self.accumulation_steps
        return config
