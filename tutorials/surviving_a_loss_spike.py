# %% [markdown]
# # Surviving a loss spike: skip the bad step, keep the evidence, replay it
#
# Somewhere in a long run one batch is broken: a NaN in an input, a label
# off by a factor of a thousand. Without protection a single NaN step makes
# every weight NaN, and the run is lost. With `skip_bad_steps` a
# `KeepGradModel` judges each step by the gradients it keeps and skips the
# optimizer update of a bad one; with `save_batches_to` it also saves the
# batch and its gradients, so that you can find out what was wrong and
# compute those gradients again later, from a checkpoint.
#
# Run: `python tutorials/surviving_a_loss_spike.py` (add `--fast` for a quick run).

# %%
import glob
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util.tensor_util import make_ndarray  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

FAST = "--fast" in sys.argv
BATCH = 32
STEPS = 40 if FAST else 400  # one pass over a stream of STEPS batches
SPIKE_STEP, NAN_STEP = 13, 19  # counted from 1
workdir = tempfile.mkdtemp()

# %% [markdown]
# ## A data stream with two bad batches
# Synthetic regression, `y = x . [1, -2, 3, 0] + noise`, read in order in
# batches of 32. Batch 13 has its targets multiplied by 1000 (a unit
# mix-up), batch 19 holds one NaN in its inputs (a missing value).

# %%
rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 3.0, 0.0], dtype="float32"))[:, None]
y += 0.1 * rng.normal(size=y.shape).astype("float32")
x_clean, y_clean = x.copy(), y.copy()


def rows(step):
    return slice((step - 1) * BATCH, step * BATCH)


y[rows(SPIKE_STEP)] *= 1000.0
x[rows(NAN_STEP)][5, 2] = np.nan
print("NaNs in x:", int(np.isnan(x).sum()), "| largest |y|:", f"{np.abs(y).max():.1f}")


def make_model(skip_bad_steps=None):
    """A small MLP, the same weights each time, on every backend."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = kg.KeepGradModel(inputs, outputs, skip_bad_steps=skip_bad_steps)
    # Glorot-uniform kernels drawn from NumPy (Keras's initializers use
    # the backend's own generator), so the numbers below are the same on
    # TensorFlow, JAX and PyTorch.
    init = np.random.default_rng(1)
    for kernel in (model.get_layer("hidden").kernel, model.get_layer("head").kernel):
        limit = np.sqrt(6.0 / sum(kernel.shape))
        kernel.assign(init.uniform(-limit, limit, kernel.shape).astype("float32"))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


# %% [markdown]
# ## Without protection
# The NaN batch alone is enough: its loss is NaN, so are its gradients,
# and Adam writes them into every weight. Every later prediction is NaN.

# %%
model = make_model()
model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
all_nan = all(np.isnan(w).all() for w in model.get_weights())
clean_loss = model.evaluate(x_clean, y_clean, batch_size=BATCH, verbose=0)
print("every weight NaN:", all_nan, "| loss on the clean data:", clean_loss)
assert all_nan and np.isnan(clean_loss)

# %% [markdown]
# ## With `skip_bad_steps`
# `SkipBadSteps(nonfinite=True)` skips a step whose kept gradients hold a
# NaN or an infinity; `spike_factor=10, window=8` also skips one whose
# global gradient norm is more than 10 times the median norm of the last
# 8 steps (checked from step 9 on, once 8 norms were seen). Each skipped
# step's batch goes to `save_batches_to`, up to `max_saved` files (the
# first ones are kept: later bad steps are often consequences of the first).
#
# Three callbacks watch: one notes the global gradient norm of each step
# from `model.gradients` (kept for skipped steps too), one saves the weights
# every 4 steps, as a long run saves checkpoints, and `GradientTensorBoard`
# writes its panels.

# %%
evidence = os.path.join(workdir, "bad_batches")
checkpoints = os.path.join(workdir, "checkpoints")
os.makedirs(evidence)
os.makedirs(checkpoints)


class GlobalNorms(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.norms = []

    def on_train_batch_end(self, batch, logs=None):
        grads = keras.tree.flatten(self.model.gradients)
        squares = sum(float(np.sum(np.square(keras.ops.convert_to_numpy(g)))) for g in grads)
        self.norms.append(np.sqrt(squares))


class EveryFourSteps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = batch + 1  # one epoch here: the batch index is the step's
        if step % 4 == 0:
            self.model.save_weights(os.path.join(checkpoints, f"step_{step:04d}.weights.h5"))


skip = kg.SkipBadSteps(
    nonfinite=True, spike_factor=10.0, window=8, save_batches_to=evidence, max_saved=5
)
model = make_model(skip_bad_steps=skip)
norms = GlobalNorms()
board = kg.callbacks.GradientTensorBoard(os.path.join(workdir, "logs"), write_heatmap=False)
history = model.fit(
    x,
    y,
    batch_size=BATCH,
    shuffle=False,
    verbose=0,
    callbacks=[norms, EveryFourSteps(), board],
)
print("skipped_steps:", history.history["skipped_steps"])
print("optimizer updates:", int(model.optimizer.iterations), "of", STEPS, "steps")
assert history.history["skipped_steps"] == [2.0]
assert int(model.optimizer.iterations) == STEPS - 2

# %% [markdown]
# The gradient norms around the bad steps: step 13's is more than 10 times
# the median of steps 5 to 12, and step 19's is NaN. Both are kept (that
# is how they were judged), but neither reached the weights.

# %%
median = float(np.median(norms.norms[SPIKE_STEP - 9 : SPIKE_STEP - 1]))
for step in range(SPIKE_STEP - 2, NAN_STEP + 2):
    note = {SPIKE_STEP: "  <- spike, skipped", NAN_STEP: "  <- NaN, skipped"}.get(step, "")
    print(f"step {step:2d}: |g| = {norms.norms[step - 1]:9.2f}{note}")
print(f"median of steps {SPIKE_STEP - 8} to {SPIKE_STEP - 1}: {median:.2f}")
assert norms.norms[SPIKE_STEP - 1] > 10 * median
assert np.isnan(norms.norms[NAN_STEP - 1])

# %% [markdown]
# The weights stay finite, and the loss on the clean data is close to that
# of a run on a stream without the two bad batches (which made two more
# updates).

# %%
weights_finite = all(np.isfinite(w).all() for w in model.get_weights())
protected_loss = model.evaluate(x_clean, y_clean, batch_size=BATCH, verbose=0)
reference = make_model()
reference.fit(x_clean, y_clean, batch_size=BATCH, shuffle=False, verbose=0)
reference_loss = reference.evaluate(x_clean, y_clean, batch_size=BATCH, verbose=0)
print("weights finite:", weights_finite)
print(f"loss on the clean data: {protected_loss:.3f} (clean stream: {reference_loss:.3f})")
assert weights_finite and protected_loss < 2 * reference_loss

# %% [markdown]
# In TensorBoard, `gradients/bad_step_skipped` marks each skipped step (the
# number of steps skipped since the previous batch, 1 here), whatever
# `update_freq` says. Read back from the event file:

# %%
events = EventAccumulator(os.path.join(workdir, "logs", "train"), size_guidance={"tensors": 0})
events.Reload()
marks = [
    (e.step, float(make_ndarray(e.tensor_proto)))
    for e in events.Tensors("gradients/bad_step_skipped")
]
print("gradients/bad_step_skipped (step, value):", marks)
assert marks == [(SPIKE_STEP, 1.0), (NAN_STEP, 1.0)]

# %% [markdown]
# ## The evidence
# One file per skipped step, `bad_step_<step>.npz`: the batch as the
# training step received it (`x`, `y`), the kept gradients of every
# variable (`grad/<variable path>`) and the step number, counted from 1
# over the steps this model trained.

# %%
files = sorted(glob.glob(os.path.join(evidence, "*.npz")))
print([os.path.basename(f) for f in files])
assert [os.path.basename(f) for f in files] == [
    f"bad_step_{SPIKE_STEP:08d}.npz",
    f"bad_step_{NAN_STEP:08d}.npz",
]
spike_file, nan_file = files
with np.load(spike_file) as saved:
    print(sorted(saved.files))
    print("step:", int(saved["step"]), "| largest |y|:", f"{np.abs(saved['y']).max():.1f}")
    assert int(saved["step"]) == SPIKE_STEP
    assert np.array_equal(saved["y"], y[rows(SPIKE_STEP)])

# %% [markdown]
# The NaN step's file holds the batch with its NaN, where it was, and
# gradients that are NaN throughout: the NaN row's loss reaches every weight.

# %%
with np.load(nan_file) as saved:
    where = np.argwhere(np.isnan(saved["x"]))
    print("step:", int(saved["step"]), "| NaN in x at (row, column):", where.tolist())
    nan_grads = [saved[k] for k in saved.files if k.startswith("grad/")]
    print("gradient entries that are NaN:", all(np.isnan(g).all() for g in nan_grads))
    assert int(saved["step"]) == NAN_STEP and where.tolist() == [[5, 2]]
    assert np.array_equal(saved["x"], x[rows(NAN_STEP)], equal_nan=True)

# %% [markdown]
# ## Replaying the spike
# `kg.replay_batch(model, path)` computes a saved batch's gradients again
# on the weights `model` has, without updating them. Any compiled model of
# the same architecture will do, on any backend. On the weights the step
# saw, those of the checkpoint of step 12 (the last one before it), they
# are the saved ones, to float32 rounding: on TensorFlow and JAX the
# training step ran as a compiled function and the replay runs eagerly, and
# the two may sum in different orders (a last-bit difference in a few
# entries); on PyTorch, eager both times, they are bit-identical.

# %%
restored = make_model()
restored.optimizer.build(restored.trainable_variables)  # so that its state loads too
restored.load_weights(os.path.join(checkpoints, f"step_{SPIKE_STEP - 1:04d}.weights.h5"))
replayed = kg.replay_batch(restored, spike_file)


def close(a, b):
    return bool(np.abs(a - b).max() <= 1e-6 * np.abs(b).max())


with np.load(spike_file) as saved:
    for path, grad in replayed.items():
        same = close(grad, saved["grad/" + path])
        print(f"{path}: |g| = {np.linalg.norm(grad):.2f}, as saved: {same}")
        assert same

# %% [markdown]
# Gradients depend on the weights: on the weights at the end of training
# the same batch gives other gradients, which is why the replay starts
# from a checkpoint taken before the bad step.

# %%
later = kg.replay_batch(model, spike_file)
with np.load(spike_file) as saved:
    same = all(close(later[p], saved["grad/" + p]) for p in later)
print("on the final weights, as saved:", same)
assert not same

# %% [markdown]
# With the targets divided by 1000 again (written to a file of the same
# keys), the same batch's gradients are ordinary: the targets were the
# problem.

# %%
with np.load(spike_file) as saved:
    fixed = {"x": saved["x"], "y": saved["y"] / 1000.0}
np.savez(os.path.join(workdir, "fixed.npz"), **fixed)
fixed_grads = kg.replay_batch(restored, os.path.join(workdir, "fixed.npz"))
fixed_norm = np.sqrt(sum(float(np.sum(np.square(g))) for g in fixed_grads.values()))
print(f"global norm with the targets fixed: {fixed_norm:.2f}")
assert fixed_norm < 10 * median
