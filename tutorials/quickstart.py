# %% [markdown]
# # Quickstart: the gradient norm in the progress bar
#
# Three changes to an ordinary Keras script:
# 1. build the model with `kg.KeepGradModel` (or wrap one: `kg.keep_gradients(model)`),
# 2. add `kg.metrics.GradientNorm()` to `compile(metrics=[...])`,
# 3. read `model.gradients` whenever you like.
#
# Run: `python tutorials/quickstart.py` (add `--fast` for a quick run).

# %%
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

FAST = "--fast" in sys.argv
keras.utils.set_random_seed(0)

# %% [markdown]
# Synthetic regression data: `y = x . [1, -2, 3, 0] + noise`.

# %%
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 3.0, 0.0], dtype="float32"))[:, None]
y += 0.1 * rng.normal(size=y.shape).astype("float32")

# %% [markdown]
# An ordinary functional model, with `kg.KeepGradModel` in place of
# `keras.Model`, and two gradient metrics beside `mae`.

# %%
inputs = keras.Input((4,))
hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
outputs = keras.layers.Dense(1, name="head")(hidden)
model = kg.KeepGradModel(inputs, outputs)
# Keras's initializers draw from the backend's own random generator; drawn
# from NumPy's (the same Glorot-uniform kernels, zero biases), and with the
# batches in order, the numbers below are the same on TensorFlow, JAX and
# PyTorch.
for kernel in (model.get_layer("hidden").kernel, model.get_layer("head").kernel):
    limit = np.sqrt(6.0 / sum(kernel.shape))
    kernel.assign(rng.uniform(-limit, limit, kernel.shape).astype("float32"))
model.compile(
    optimizer=keras.optimizers.Adam(0.01),
    loss="mse",
    metrics=["mae", kg.metrics.GradientNorm(), kg.metrics.GradientNorm(per_layer=True)],
)
history = model.fit(x, y, batch_size=64, epochs=2 if FAST else 10, shuffle=False, verbose=2)

# %% [markdown]
# `grad_norm` (the global L2 norm, averaged over the epoch's steps) and one
# `grad_norm/<layer>` per layer are in `History`, the progress bar, CSVLogger
# and TensorBoard's scalars, like any metric. They are absent from
# `evaluate()`: there are no gradients there.

# %%
print(sorted(history.history))
assert "grad_norm" in history.history and "grad_norm/hidden" in history.history
results = model.evaluate(x, y, verbose=0, return_dict=True)
# Rounded as the progress bar rounds: a float32's last digit can differ
# from one machine to another.
print("evaluate:", {name: round(value, 4) for name, value in results.items()})
assert "grad_norm" not in results

# %% [markdown]
# The last batch's gradients themselves, shaped like the variables:

# %%
# As NumPy arrays: the leaves are the backend's tensors (`tf.Tensor`,
# `jax.Array` or `torch.Tensor`), which `keras.ops.convert_to_numpy` reads.
grads = keras.tree.map_structure(keras.ops.convert_to_numpy, model.gradients)
for layer, variables in grads.items():
    for name, g in variables.items():
        print(f"{layer}/{name}: shape {tuple(g.shape)}, |g| = {float(np.linalg.norm(g)):.4f}")

# Their global norm, by hand: the last step's value (the logged grad_norm
# is the epoch's mean over steps, so it differs).
last_norm = np.sqrt(sum(float(np.sum(np.square(g))) for v in grads.values() for g in v.values()))
print(f"global norm of the last batch: {last_norm:.4f}")
assert last_norm > 0
