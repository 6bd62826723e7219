# %% [markdown]
# # Mixed precision: unscaled gradients and skipped steps
#
# Under the `mixed_float16` policy Keras wraps your optimizer in a
# `LossScaleOptimizer`: the loss is multiplied by a large *loss scale*
# (2**15 to start) so that small float16 gradients do not underflow, and the
# optimizer divides the gradients by that scale again before updating. When a
# scaled gradient overflows, the step is skipped and the scale halves.
#
# A callback that recomputes gradients sees none of this; `KeepGradModel`
# keeps what the optimizer's update receives: **unscaled**, in **float32**, and,
# on a skipped step, that step's non-finite values so you can see the cause.
#
# Run: `python tutorials/mixed_precision.py` (add `--fast` for a quick run).

# %%
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

FAST = "--fast" in sys.argv
STEPS = 6 if FAST else 12

# %% [markdown]
# One bias-free `Dense(1)` with weight 3 on `x = [[1], [2]]`, `y = 0`, mse:
# `loss = mean((w x)^2)` so `d loss / d w = 5 w = 15`. Every number below can
# be checked by hand, and all of them are exact in float16.

# %%
keras.config.set_dtype_policy("mixed_float16")
inputs = keras.Input((1,))
layer = keras.layers.Dense(
    1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
)
model = kg.KeepGradModel(inputs, layer(inputs))
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
print("optimizer:", type(model.optimizer).__name__)  # Keras added the loss scaling
print("kernel dtype:", layer.kernel.dtype, "| compute dtype:", layer.compute_dtype)

# %% [markdown]
# Train one step at a time and look at the kept gradient, the loss scale and
# the weight. The first steps overflow: the scaled kernel gradient,
# `15 * scale`, does not fit in float16 (max 65504) until the scale is down
# to 4096, so Keras skips them and halves the scale; the kept gradient
# is `inf`, the weight does not move. At scale 4096 the step goes through and
# the kept gradient is exactly `5 w = 15`, unscaled, in float32.

# %%
x = np.array([[1.0], [2.0]], dtype="float32")
y = np.zeros((2, 1), dtype="float32")
rows = []
for step in range(1, STEPS + 1):
    scale_before = (
        float(model.optimizer.dynamic_scale.numpy()) if model.optimizer.built else 2.0**15
    )
    w_before = float(layer.kernel.numpy()[0, 0])
    model.train_on_batch(x, y)
    grad = model.gradients["dense_0"]["kernel"]
    # `np.asarray` reads a TensorFlow tensor and a JAX array alike.
    value, dtype = float(np.asarray(grad)[0, 0]), keras.backend.standardize_dtype(grad.dtype)
    rows.append((step, scale_before, w_before, value, dtype))
    print(
        f"step {step}: scale {scale_before:>7.0f}  w {w_before:.6f}  "
        f"kept grad {value:>10.6f} ({dtype})"
    )

# %%
finite = [r for r in rows if np.isfinite(r[3])]
skipped = [r for r in rows if not np.isfinite(r[3])]
assert len(skipped) == 3, skipped
assert finite[0][1] == 4096.0 and finite[0][3] == 15.0
for step, _, w, g, dtype in finite:
    assert g == 5 * w and dtype == "float32", (step, w, g)
print(
    f"\n{len(skipped)} skipped steps kept their non-finite gradients;"
    f" {len(finite)} steps kept exactly 5w."
)

# %% [markdown]
# The same numbers without mixed precision: the kept gradients of the
# finite steps are identical, because they are unscaled.

# %%
keras.config.set_dtype_policy("float32")
inputs = keras.Input((1,))
reference = kg.KeepGradModel(
    inputs,
    keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
    )(inputs),
)
reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
reference.train_on_batch(x, y)
print("float32 kept gradient:", float(np.asarray(reference.gradients["dense_0"]["kernel"])[0, 0]))
assert float(np.asarray(reference.gradients["dense_0"]["kernel"])[0, 0]) == finite[0][3]
