"""Replaying a batch's gradients on JAX: a saved batch (`_evidence`), and
each device's rows of a bad step under `DataParallel` (`_replicas`).

Under `keras.distribution.DataParallel` Keras's JAX step takes the
gradient of the global batch's loss on sharded arrays, and XLA sums the
devices' shares inside the compiled gradient: they never exist as arrays.
Where the kept gradients are not finite, the step replays each device's
rows alone (`bad_devices`), inside the same compiled step, from the state
it began with, in a branch that runs only then. The branch makes XLA keep
a copy of the weights each step (the update overwrites them in place), so
it is compiled only where the model judges its steps (`devices_to_name`).
"""

import jax
import jax.numpy as jnp
import keras

from keras_keepgrad import _replicas
from keras_keepgrad import _squares

__all__ = ["bad_devices", "devices_to_name", "replay_gradients"]


def replay_gradients(model, x, y, sample_weight, scale, state=None):
    """The gradients of `model`'s compiled loss on one batch, as its
    training step computes them (see `_evidence.replay_batch`), from the
    variables' values or from a step's `state`."""
    return [g / scale for g in _scaled_gradients(model, x, y, sample_weight, scale, state)]


def _scaled_gradients(model, x, y, sample_weight, scale, state=None):
    """The gradients of `scale` times `model`'s compiled loss on one batch."""
    if state is None:
        state = [
            [v.value for v in variables]
            for variables in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.optimizer.variables,
                model.metrics_variables,
            )
        ]
    trainable, non_trainable, optimizer, metrics = state

    def loss_of(values):
        _, aux = model.compute_loss_and_updates(
            values,
            non_trainable,
            metrics,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer,
        )
        return aux[0] * scale  # the loss as computed, before any scaling

    return jax.grad(loss_of)(trainable)


def devices_to_name(model):
    """How many devices `bad_devices` replays on `model`'s steps: those of
    `DataParallel`, where the model judges its steps (`skip_bad_steps`)
    with Keras's own step (whose loss the replay recomputes); 1 (none)
    else (`_replicas.replay_refused` says why)."""
    return 1 if _replicas.replay_refused(model) else _replicas.replica_count(model)


def bad_devices(model, state, data, finite, count):
    """Bool `[count]`: whether each device's rows of the batch, alone,
    give a non-finite gradient (see `_replicas`); computed only where
    `finite` (whether the step's kept gradients are) is false.

    Each device's replay is Keras's step on its rows (device `d` of `n`
    holds rows `d * B / n` to `(d + 1) * B / n`), from the step's starting
    `state`, with the loss scaled by the step's loss scale over `n`: the
    size of that device's share of the scaled gradient, for a loss that
    is a mean over the batch (Keras's default reduction).
    """
    optimizer = model.optimizer
    scale = 1.0
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        index = [id(v) for v in optimizer.variables].index(id(optimizer.dynamic_scale))
        scale = state[2][index]
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def rows(t):
        return jnp.reshape(t, (count, t.shape[0] // count, *t.shape[1:]))

    def bad(batch):
        # As scaled in the step: what overflows there overflows here.
        grads = _scaled_gradients(model, *batch, scale / count, state)
        return jnp.logical_not(_squares.entries_finite(list(grads)))

    def replay(batch):
        return jax.lax.map(bad, jax.tree_util.tree_map(rows, batch))

    return jax.lax.cond(
        finite, lambda batch: jnp.zeros((count,), bool), replay, (x, y, sample_weight)
    )
