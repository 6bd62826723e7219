# %% [markdown]
# # Writing your own gradient metric and callback
#
# Two ways to look at the kept gradients:
# - a **metric** runs inside the training step, on every step, in the graph:
#   wrap any function of the gradient structure in `kg.metrics.GradientMetric`;
# - a **callback** runs between steps in Python: read `self.model.gradients`
#   (or the flat `self.model.get_gradients_by_path()`) in `on_train_batch_end`.
#
# Every number below is checked by hand on a one-weight model:
# `Dense(1, use_bias=False)` with `w = 3`, `x = [[1], [2]]`, `y = 0`, mse:
# `d loss / d w = 5 w`, and SGD(0.1) halves `w` each step: 15, 7.5, 3.75.
#
# Run: `python tutorials/custom_metric_and_callback.py` (`--fast` is accepted).

# %%
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

x = np.tile(np.array([[1.0], [2.0]], dtype="float32"), (3, 1))
y = np.zeros((6, 1), dtype="float32")

# %% [markdown]
# ## A metric: the kernel's gradient, as "last" and as "mean"
# `fn` receives the nested dict of float32 tensors and returns a scalar. It
# is traced into the training step, so use `keras.ops`. Register it so a
# saved model can find it again.


# %%
@keras.saving.register_keras_serializable(package="tutorial")
def kernel_grad(grads):
    return ops.sum(grads["dense_0"]["kernel"])


def one_weight_model():
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
    )
    return kg.KeepGradModel(inputs, dense(inputs))


# %% [markdown]
# ## A callback: keep a history of the kernel's gradient, and stop on a spike


# %%
class KernelGradientLog(keras.callbacks.Callback):
    """Records the kernel gradient after every batch; stops above `limit`."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        g = float(self.model.gradients["dense_0"]["kernel"][0, 0])
        self.values.append(g)
        if abs(g) > self.limit:
            print(f"gradient {g} above {self.limit}: stopping")
            self.model.stop_training = True


# %%
model = one_weight_model()
model.compile(
    optimizer=keras.optimizers.SGD(0.1),
    loss="mse",
    metrics=[
        kg.metrics.GradientMetric(kernel_grad, name="kernel_grad_mean"),
        kg.metrics.GradientMetric(kernel_grad, name="kernel_grad_last", reduction="last"),
    ],
)
log = KernelGradientLog(limit=100.0)
history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=2, callbacks=[log])

# %% [markdown]
# Three steps, 15, 7.5, 3.75: the callback saw each; the "mean" metric is
# (15 + 7.5 + 3.75) / 3 = 8.75 and the "last" one 3.75.

# %%
print("callback saw:", log.values)
print("metrics:", {k: v for k, v in history.history.items() if k.startswith("kernel")})
assert log.values == [15.0, 7.5, 3.75]
assert history.history["kernel_grad_mean"] == [8.75]
assert history.history["kernel_grad_last"] == [3.75]

# %% [markdown]
# The callback's stop: a learning rate of 1.5 makes `w` grow
# (w <- w - 1.5 * 5w = -6.5 w), so the gradient explodes: 15, -97.5, 633.75.

# %%
model = one_weight_model()
model.compile(optimizer=keras.optimizers.SGD(1.5), loss="mse")
log = KernelGradientLog(limit=100.0)
model.fit(
    np.tile(x, (3, 1)), np.tile(y, (3, 1)), batch_size=2, shuffle=False, verbose=0, callbacks=[log]
)
print("callback saw:", log.values)
assert log.values == [15.0, -97.5, 633.75]
