"""Helpers of the callback tests: the hand model, its data, event files.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import keras
import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import keras_keepgrad as kg


def hand_model(lr=0.1, optimizer=None, keep_every=1, **compile_kwargs):
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(3.0),
        name="dense_0",
    )(inputs)
    model = kg.KeepGradModel(inputs, outputs, keep_every=keep_every)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(lr), loss="mse", **compile_kwargs)
    return model


def hand_data(batches):
    x = np.tile(np.array([[1.0], [2.0]]), (batches, 1))
    return x, np.zeros_like(x)


def two_layer_model(names=("dense_0", "dense_1"), cls=kg.KeepGradModel, **kwargs):
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(
        3, kernel_initializer="ones", bias_initializer="ones", name=names[0]
    )(inputs)
    outputs = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.Constant(0.5),
        name=names[1],
    )(hidden)
    model = cls(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", **kwargs)
    return model


def tape_gradients(model, x, y, batch_size, epochs):
    """Each step's `{path: gradient}` of a plain model trained batch by batch
    in order with the backend's own differentiation (a `tf.GradientTape`,
    `jax.grad`, PyTorch's autograd) and its optimizer: the reference."""
    found = []
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            xb = np.asarray(x[start : start + batch_size], "float32")
            yb = np.asarray(y[start : start + batch_size], "float32")
            variables = model.trainable_variables
            grads = _mse_gradients(model, xb, yb)
            model.optimizer.apply(grads, variables)
            found.append({v.path: keras.ops.convert_to_numpy(g) for v, g in zip(variables, grads)})
    return found


def _mse_gradients(model, x, y):
    variables = model.trainable_variables
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss_fn(trainable):
            y_pred, _ = model.stateless_call(
                trainable, [v.value for v in model.non_trainable_variables], x
            )
            return jnp.mean(jnp.square(y_pred - y))

        return jax.grad(loss_fn)([v.value for v in variables])
    if backend == "torch":
        import torch

        loss = torch.mean(torch.square(model(x) - torch.as_tensor(y)))
        return list(torch.autograd.grad(loss, [v.value for v in variables]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, variables)


def layer_norms(grads):
    """Reference per-layer norms: path minus last component, in order."""
    sums = {}
    for path, grad in grads.items():
        layer = path.rpartition("/")[0]
        sums[layer] = sums.get(layer, 0.0) + float(np.sum(np.square(grad.astype(np.float64))))
    return {layer: np.sqrt(total) for layer, total in sums.items()}


def read_run(directory):
    acc = event_accumulator.EventAccumulator(
        directory, size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
