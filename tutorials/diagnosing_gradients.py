# %% [markdown]
# # Diagnosing vanishing and exploding gradients with TensorBoard panels
#
# A deep stack of sigmoid layers trains badly: the sigmoid's derivative is at
# most 1/4, so the gradient shrinks by that factor (or more) at every layer
# on the way back, and the first layers barely learn. Too large a learning
# rate does the opposite: the gradients grow step after step.
#
# `kg.callbacks.GradientTensorBoard` writes, beside everything Keras's own
# `TensorBoard` writes, per-layer gradient norms, the global norm,
# histograms, a layers x steps heatmap and a "Gradient panels" layout;
# `kg.callbacks.GradientMonitor` names the layers in trouble as it happens.
#
# Run: `python tutorials/diagnosing_gradients.py` (add `--fast` for a quick
# run), then `tensorboard --logdir runs/diagnosing` and open the
# "Custom Scalars" tab.

# %%
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

FAST = "--fast" in sys.argv
LOGDIR = "runs/diagnosing"
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 16)).astype("float32")
y = (x[:, :1] > 0).astype("float32")


def mlp(activation, depth=8, name=None, out_activation="sigmoid"):
    inputs = keras.Input((16,))
    h = inputs
    for i in range(depth):
        h = keras.layers.Dense(32, activation=activation, name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(1, activation=out_activation, name="out")(h)
    model = kg.KeepGradModel(inputs, outputs, name=name)
    # Keras's default Glorot-uniform kernels, drawn by NumPy rather than by
    # the backend's own generator: the same numbers on TensorFlow, JAX and
    # PyTorch (with the batches in order, `shuffle=False`).
    init = np.random.default_rng(0)
    for layer in model.layers[1:]:
        limit = np.sqrt(6.0 / sum(layer.kernel.shape))
        layer.kernel.assign(init.uniform(-limit, limit, layer.kernel.shape).astype("float32"))
    return model


# %% [markdown]
# ## Vanishing: a deep sigmoid MLP
# The monitor reports a layer whose gradient norm stays below `1e-5` for
# five checks in a row; the TensorBoard callback writes the norms every 4
# batches and the histograms every epoch.

# %%
model = mlp("sigmoid", name="sigmoid_mlp")
model.compile(
    optimizer=keras.optimizers.SGD(0.05),
    loss="binary_crossentropy",
    metrics=[kg.metrics.GradientNorm(per_layer=True)],
)
monitor = kg.callbacks.GradientMonitor(vanishing_threshold=1e-5, vanishing_steps=5)
board = kg.callbacks.GradientTensorBoard(
    os.path.join(LOGDIR, "sigmoid"), update_freq=4, histogram_freq=1
)
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    history = model.fit(
        x,
        y,
        batch_size=64,
        epochs=1 if FAST else 5,
        shuffle=False,
        verbose=0,
        callbacks=[monitor, board],
    )
for event in monitor.events:
    print(event["message"])
vanishing = {layer for e in monitor.events if e["kind"] == "vanishing" for layer in e["layers"]}
assert "dense_0" in vanishing, monitor.events

# %% [markdown]
# The per-layer norms, read back from the event file exactly as TensorBoard
# shows them: the first layer's gradient is orders of magnitude smaller
# than the last one's.

# %%
acc = EventAccumulator(os.path.join(LOGDIR, "sigmoid", "train"), size_guidance={"tensors": 0})
acc.Reload()


def last_norm(layer):
    """The layer's last norm: the tags hold log10 of it."""
    tag = "gradients/log10_norm/" + layer
    return 10.0 ** float(tf.make_ndarray(acc.Tensors(tag)[-1].tensor_proto))


first, last = last_norm("dense_0"), last_norm("out")
print(f"dense_0: {first:.3e}   out: {last:.3e}   ratio {last / first:.0f}x")
assert last / first > 1e3
print(
    "panels written:",
    sorted(t for t in acc.Tags()["tensors"] if t.startswith("gradients/"))[:4],
    "...",
)

# %% [markdown]
# ## The fix: ReLU keeps the gradients alive

# %%
model = mlp("relu", name="relu_mlp")
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
monitor = kg.callbacks.GradientMonitor(vanishing_threshold=1e-5, vanishing_steps=5)
board = kg.callbacks.GradientTensorBoard(os.path.join(LOGDIR, "relu"), update_freq=4)
model.fit(
    x,
    y,
    batch_size=64,
    epochs=1 if FAST else 5,
    shuffle=False,
    verbose=0,
    callbacks=[monitor, board],
)
print("monitor events with ReLU:", monitor.events)
assert monitor.events == []

# %% [markdown]
# ## Exploding: too large a learning rate
# A deep linear stack with SGD(0.5): every step overshoots, the weights grow,
# and the gradients with them. `exploding_threshold` flags a global norm
# above 1000 (`exploding_factor` compares with the running median instead);
# `action="stop"` ends training at the first explosion instead of wasting
# the run.

# %%
model = mlp("linear", depth=4, name="exploding_mlp", out_activation="linear")
model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
monitor = kg.callbacks.GradientMonitor(action="stop", exploding_threshold=1e3)
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    history = model.fit(
        x, y, batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[monitor]
    )
print(monitor.events[0]["message"] if monitor.events else "no explosion")
assert monitor.events and monitor.events[0]["kind"] == "exploding"
print(
    f"stopped after step {monitor.events[0]['step']}, in epoch {len(history.history['loss'])} of 3"
)
assert len(history.history["loss"]) == 1
print(f"\nOpen the panels with: tensorboard --logdir {LOGDIR}")
