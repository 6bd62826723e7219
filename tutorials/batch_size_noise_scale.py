# %% [markdown]
# # Choosing a batch size with the gradient noise scale
#
# Doubling the batch halves the number of steps only while the gradient is
# dominated by noise. McCandlish et al. (2018), "An Empirical Model of
# Large-Batch Training", measure where that stops: the *gradient noise
# scale* `B_simple = tr(Sigma) / |G|^2` (per-example gradient covariance
# over squared true gradient). Well below it, larger batches save steps
# almost one for one; well above it, they only cost examples.
#
# This tutorial measures `B_simple` with `kg.metrics.GradientNoiseScale`
# in one ordinary training run, then, from the weights that run reached,
# trains the same model with batch sizes from 4 to 1024 (each with its
# best learning rate), one step at a time, and checks that the measured
# noise scale is where larger batches stop paying.
#
# Run: `python tutorials/batch_size_noise_scale.py` (add `--fast` for a
# quick run).

# %%
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

FAST = "--fast" in sys.argv
keras.utils.set_random_seed(0)

# %% [markdown]
# ## The problem: noisy linear regression
# `y = w* . x + noise`, `x ~ N(0, I_32)`, noise of standard deviation 1,
# a linear model trained with SGD on the mean squared error from `w = 0`.
# The excess loss `|w - w*|^2` (the loss minus the noise's 1) starts at
# `|w*|^2` (21 for this seed); the goal is an excess loss of 1.
#
# Here the noise scale has a closed form: at `w = w* + u` it is
# `B_simple = (d + 1) + d sigma^2 / |u|^2` (see the docs' derivation), 65
# at the target. It grows as training goes: the closer the weights get,
# the smaller the true gradient against the noise of the examples, so the
# batch size that pays grows too.

# %%
D, SIGMA, TARGET = 32, 1.0, 1.0
rng = np.random.default_rng(0)
w_star = rng.normal(size=(D, 1)).astype("float32")
POOL = 2**15 if FAST else 2**16
x_pool = rng.normal(size=(POOL, D)).astype("float32")
y_pool = x_pool @ w_star + SIGMA * rng.normal(size=(POOL, 1)).astype("float32")
print(f"initial excess loss |w*|^2 = {float(np.sum(w_star**2)):.1f}")
print(f"closed-form B_simple at the target: {(D + 1) + D * SIGMA**2 / TARGET:.0f}")


def linear_model(metrics=()):
    inputs = keras.Input((D,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="linear")(
        inputs
    )
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=list(metrics))
    return model


def excess_loss(model):
    kernel = np.asarray(model.get_layer("linear").kernel)
    return float(np.sum((kernel - w_star) ** 2))


def batches(batch_size, seed):
    data = tf.data.Dataset.from_tensor_slices((x_pool, y_pool))
    return data.shuffle(POOL, seed=seed).repeat().batch(batch_size, drop_remainder=True)


# %% [markdown]
# ## Measuring the noise scale during training
# One run at batch 64 with a small learning rate, until the excess loss
# reaches the target, with `GradientNoiseScale` among the metrics. On one device it takes the big
# batch as the mean of `accumulation_steps` consecutive steps' gradients
# (4 by default): the weights move a little between them, which biases the
# estimate upward by a small amount at this learning rate (see the docs).
# The moving average (`smoothing=0.95`, about 20 windows, 80 steps) lags
# behind: `B_simple` rises as the loss falls, so at the target the logged
# value reads below the closed form at the final weights (about 55 against
# 65), close to the closed form averaged over the last steps as the metric
# weighs them. A callback notes the logged value at every step, beside the
# excess loss.


# %%
class Trace(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append((excess_loss(self.model), float(logs["grad_noise_scale"])))


class StopAtTarget(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if excess_loss(self.model) <= TARGET:
            self.model.stop_training = True


model = linear_model([kg.metrics.GradientNoiseScale(smoothing=0.95)])
model.optimizer.learning_rate.assign(0.001)
trace = Trace()
model.fit(
    batches(64, seed=1),
    steps_per_epoch=5000,
    epochs=1,
    shuffle=False,  # the dataset shuffles itself
    verbose=0,
    callbacks=[trace, StopAtTarget()],
)
excess, noise_scale = np.array(trace.rows).T
for i in range(199, len(trace.rows), 200):
    print(f"step {i + 1:3d}: excess loss {excess[i]:6.2f}, B_simple {noise_scale[i]:6.1f}")
measured = float(noise_scale[-1])
print(f"\nB_simple at the target (step {len(excess)}, excess {excess[-1]:.3f}): {measured:.1f}")
closed_form = (D + 1) + D * SIGMA**2 / excess[-1]
print(f"closed form at these weights: {closed_form:.1f}")
assert 0.7 * closed_form < measured < 1.3 * closed_form, (measured, closed_form)

# %% [markdown]
# ## The batch-size sweep, one step at a time
# From the weights where training reached the target, take one SGD step
# at each batch size with each learning rate of a grid, many times over
# (the weights are put back before every step, and every learning rate
# sees the same batches), and measure how much the excess loss falls on
# average. The best learning rate's decrease is the progress a step of
# that batch size can make here; the steps a stretch of training needs
# scale as its inverse, the examples as the batch size over it.
#
# The paper's model of one step: with the best learning rate, the
# expected decrease is `dL_max / (1 + B_noise / B)`, where `dL_max` is what
# the true gradient would achieve and `B_noise = B_simple` when the loss's
# curvature is the same in every direction, as here. So `1 / dL` is a
# straight line in `1 / B`, and its slope over its intercept is the noise
# scale: at `B = B_simple` a step does half of what a noise-free one does.

# %%
checkpoint = keras.ops.convert_to_numpy(model.get_layer("linear").kernel)
start = excess_loss(model)
BATCHES = [4, 16, 64, 256, 1024] if FAST else [4, 8, 16, 32, 64, 128, 256, 512, 1024]
RATES = 0.5 * np.sqrt(0.5) ** np.arange(12)
TRIALS = 50 if FAST else 200


class OneStepFromCheckpoint(keras.callbacks.Callback):
    """Puts the checkpoint back before every step; notes the excess after."""

    def on_train_begin(self, logs=None):
        self.after = []

    def on_train_batch_begin(self, batch, logs=None):
        self.model.get_layer("linear").kernel.assign(checkpoint)

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(excess_loss(self.model))


decrease = {}
for batch_size in BATCHES:
    sweep = linear_model()
    best = None
    for rate in RATES:
        sweep.optimizer.learning_rate.assign(rate)
        steps = OneStepFromCheckpoint()
        sweep.fit(
            batches(batch_size, seed=2),
            steps_per_epoch=TRIALS,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[steps],
        )
        gain = start - float(np.mean(steps.after))
        if best is None or gain > best[0]:
            best = (gain, float(rate))
    decrease[batch_size] = best

# %% [markdown]
# ## Reading the sweep

# %%
sizes = np.array(list(decrease), dtype="float64")
gains = np.array([decrease[b][0] for b in decrease])
# Least squares on the relative error of each decrease (rows scaled by it).
design = np.stack([gains, gains / sizes], axis=1)
(intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(gains), rcond=None)
b_noise = slope / intercept
best_steps = 1.0 / gains.max()
min_examples = float(np.min(sizes / gains))
print(" batch   best rate   decrease/step   steps (x min)   examples (x min)")
for b, (gain, rate) in decrease.items():
    print(
        f"{b:6d}   {rate:9.4f}   {gain:13.4f}   {1.0 / gain / best_steps:13.2f}   "
        f"{b / gain / min_examples:16.2f}"
    )
print(f"\nfitted B_noise = {b_noise:.1f}; measured B_simple during training = {measured:.1f}")
assert 0.6 * measured < b_noise < 1.6 * measured, (b_noise, measured)

# Well below the noise scale a 4x larger batch makes a step nearly 4x as
# useful; well above it, barely more useful at all.
for b in decrease:
    if 4 * b in decrease and (4 * b <= measured / 2 or b >= 2 * measured):
        ratio = decrease[4 * b][0] / decrease[b][0]
        print(f"batch {b} -> {4 * b}: a step does {ratio:.2f}x as much")
        assert ratio > 2.0 if 4 * b <= measured / 2 else ratio < 1.6, (b, ratio)

# %% [markdown]
# ## What to take away
# - At `B_simple` (here measured about 55, the closed form 65 at the
#   target) a step costs about twice
#   the fewest steps and about twice the fewest examples (batch 64 in the
#   table): the balanced choice. Below it, batches need proportionally
#   more steps; above it, proportionally more examples, for the same
#   progress.
# - `B_simple` grows as the loss falls (see the first run): measure it
#   where training spends its time, and consider growing the batch during
#   training.
# - On a `tf.distribute` strategy with several replicas in one process the
#   metric uses the replicas' batches as the small batches: no
#   accumulation, no bias from moving weights, and an estimate every step.
