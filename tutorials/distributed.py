# %% [markdown]
# # Distributed training: the global batch's gradients
#
# Under `tf.distribute.MirroredStrategy` each device (a *replica*) runs the
# training step on its share of the batch, and Keras divides each replica's
# loss by the number of replicas. A replica's gradient is therefore a
# *partial* gradient; the optimizer sums them (all-reduce) before updating.
# A callback that recomputes gradients on one replica, or a hand-written
# `train_step` that stores them, sees a partial gradient.
#
# `KeepGradModel` keeps the **sum**: `model.gradients`, gradient metrics and
# callbacks see exactly what one device computes on the same global batch.
# This tutorial shows it on 2 logical CPUs (the same code runs on GPUs), then
# with mixed precision, then skipping bad steps, then across two worker
# processes with `MultiWorkerMirroredStrategy`.
#
# Run: `python tutorials/distributed.py` (add `--fast` for a quick run).

# %%
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FAST = "--fast" in sys.argv
WORKER = "--worker" in sys.argv

# TensorFlow fixes its devices when it runs its first op, so split the CPU
# into two logical devices now. On a machine with several GPUs, skip this:
# `MirroredStrategy()` then uses every GPU.
if not WORKER:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )

import keras  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

# %% [markdown]
# ## Part 1: the one-weight model, by hand
#
# A bias-free `Dense(1)` with weight `w = 3`, `x = [[1], [2]]`, `y = 0`, mse:
# `loss = mean((w x)^2)` and `d loss / d w = 5 w = 15`.
#
# With a global batch of 2 on 2 replicas, replica 0 gets `x = 1` and
# computes `2 w * 1 / 2 = 3` (its loss is divided by 2), replica 1 gets
# `x = 2` and computes `2 w * 4 / 2 = 12`. The global gradient is `3 + 12`.
# Build the model (and compile it) inside `strategy.scope()`.


# %%
def one_weight_model(strategy, **compile_kwargs):
    with strategy.scope():
        inputs = keras.Input((1,))
        layer = keras.layers.Dense(
            1,
            use_bias=False,
            kernel_initializer=keras.initializers.Constant(3.0),
            name="dense_0",
        )
        model = kg.KeepGradModel(inputs, layer(inputs))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            metrics=[kg.metrics.GradientNorm(), kg.metrics.NonFiniteGradients()],
            **compile_kwargs,
        )
    return model


def one_weight_data():
    x = np.array([[1.0], [2.0]], dtype="float32")
    return tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(2)


if not WORKER:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print("replicas:", strategy.num_replicas_in_sync)
    model = one_weight_model(strategy)
    history = model.fit(one_weight_data(), epochs=1, verbose=0, shuffle=False)
    kept = float(model.gradients["dense_0"]["kernel"].numpy()[0, 0])
    print("kept gradient:", kept, "| grad_norm logged:", history.history["grad_norm"])
    print("weight after SGD(0.1):", float(model.layers[-1].kernel.numpy()[0, 0]))
    assert kept == 15.0 and history.history["grad_norm"] == [15.0]

# %% [markdown]
# ## Part 2: a real model against one device
#
# An embedding (sparse gradients), a frozen layer, and an MLP, trained for a
# few steps under the strategy and, from the same weights, on one device. A
# callback records `model.gradients` after every batch; the two runs agree
# to float32 round-off (the replicas sum in a different order).

# %%
STEPS = 3 if FAST else 20
rng = np.random.default_rng(0)
ids = rng.integers(0, 50, size=(16 * STEPS, 4)).astype("int32")
targets = rng.normal(size=(16 * STEPS, 1)).astype("float32")


def embedding_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,), dtype="int32")
        h = keras.layers.Embedding(50, 8, name="embedding")(inputs)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
        h = keras.layers.Dense(16, activation="relu", name="frozen", trainable=False)(h)
        outputs = keras.layers.Dense(1, name="out")(h)
        model = kg.KeepGradModel(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[kg.metrics.GradientNorm()]
        )
    return model


class RecordGradients(keras.callbacks.Callback):
    """Keeps a numpy copy of `model.gradients` after every batch."""

    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(
            {path: g.numpy() for path, g in self.model.get_gradients_by_path().items()}
        )


def train(strategy, weights=None):
    model = embedding_model(strategy)
    if weights is not None:
        model.set_weights(weights)
    weights = model.get_weights()
    record = RecordGradients()
    data = tf.data.Dataset.from_tensor_slices((ids, targets)).batch(16)
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[record])
    return weights, record.steps


if not WORKER:
    with tf.device("/cpu:0"):
        start, one_device = train(tf.distribute.get_strategy())
    _, mirrored = train(strategy, start)
    worst = 0.0
    for step_one, step_two in zip(one_device, mirrored):
        for path in step_one:
            scale = np.max(np.abs(step_one[path])) or 1.0
            worst = max(worst, float(np.max(np.abs(step_two[path] - step_one[path])) / scale))
    print(f"{len(mirrored)} steps, kept variables: {sorted(mirrored[0])}")
    print(f"largest difference from one device, relative: {worst:.1e}")
    assert "frozen/kernel" not in mirrored[0] and worst < 1e-5

# %% [markdown]
# ## Part 3: mixed precision and skipped steps
#
# Under `mixed_float16` the scaled float16 gradients overflow until the loss
# scale is small enough (see `mixed_precision.py`). With two replicas they
# need not overflow together: at scale 16384 replica 0's partial
# `3 * 16384` fits in float16, replica 1's `12 * 16384` does not.
#
# Keras 3.15's `LossScaleOptimizer` decides from replica 0 alone and would
# apply that step, turning the weight into NaN. `KeepGradModel` lets the
# replicas agree: a step is skipped when any replica overflows, so the weight
# survives, the scale halves, and the kept (unscaled, float32) gradient shows
# the overflow; `grad_nonfinite` counts it on every replica.

# %%
if not WORKER:
    keras.config.set_dtype_policy("mixed_float16")
    model = one_weight_model(strategy)
    keras.config.set_dtype_policy("float32")
    data = one_weight_data().repeat(4)
    print("step  scale  kept gradient  weight after")
    for step, batch in enumerate(data, start=1):
        scale = float(model.optimizer.dynamic_scale.numpy()) if model.optimizer.built else 2.0**15
        logs = model.fit(tf.data.Dataset.from_tensors(batch), verbose=0, shuffle=False).history
        kept = float(model.gradients["dense_0"]["kernel"].numpy()[0, 0])
        weight = float(model.layers[-1].kernel.numpy()[0, 0])
        print(
            f"{step:>4} {scale:>6.0f} {kept:>14} {weight:>12}  "
            f"(grad_nonfinite {logs['grad_nonfinite'][0]:.0f})"
        )
    assert kept == 15.0 and weight == 1.5

# %% [markdown]
# ## Part 4: skipping bad steps on every replica
#
# With `skip_bad_steps`, every replica judges the **global** gradient (the
# sum of the partial ones), so all replicas skip a bad step or apply it
# alike, as one device would. Below, the second batch holds a NaN in
# replica 1's share, and the third, `x = [[4], [4]]` at `w = 1.5`, is a
# spike: its global gradient `1.5 * 32 = 48` is beyond `spike_factor = 2`
# times the last norm, 15, although neither replica's partial gradient,
# 24, is. Both are skipped on both replicas. Each skipped step's file
# holds the whole global batch, both replicas' rows.

# %%
if not WORKER:
    import tempfile

    saved = tempfile.mkdtemp()
    skip = kg.SkipBadSteps(spike_factor=2.0, window=1, save_batches_to=saved)
    with strategy.scope():
        inputs = keras.Input((1,))
        layer = keras.layers.Dense(
            1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0)
        )
        model = kg.KeepGradModel(inputs, layer(inputs), skip_bad_steps=skip)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    print("x          kept gradient  weight after  skipped  first bad replica")
    for rows in ([1.0, 2.0], [1.0, np.nan], [4.0, 4.0]):
        x = np.array(rows, "float32").reshape(-1, 1)
        data = tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(2)
        logs = model.fit(data, verbose=0, shuffle=False).history
        kept = float(model.gradients[layer.name]["kernel"].numpy()[0, 0])
        weight = float(layer.kernel.numpy()[0, 0])
        print(
            f"{str(rows):<10} {kept:>14} {weight:>13} {logs['skipped_steps'][0]:>8.0f}"
            f"  {model.first_bad_replica}"
        )
    files = sorted(os.listdir(saved))
    print("saved:", files)
    with np.load(os.path.join(saved, files[-1])) as f:
        print("x in", files[-1], "->", f["x"].ravel().tolist())
    assert weight == 1.5 and len(files) == 2

# %% [markdown]
# ## Part 5: several machines, `MultiWorkerMirroredStrategy`
#
# Each worker is a process with a `TF_CONFIG` naming the cluster and its own
# index. Keras 3.15's own `fit` fails under this strategy (its build reduces
# the per-replica batch, and its scalar logs lack the axis it reduces over);
# `KeepGradModel.fit` works: it builds from the dataset's spec and gives the
# logs the axis that Keras's cross-worker mean expects. Each worker trains on
# its shard (`AutoShardPolicy.DATA`: worker 0 gets `x = 1`, worker 1
# `x = 2`), the step all-reduces the gradients, and every worker keeps the
# same global gradient, readable locally.
#
# Then each worker turns on `skip_bad_steps` and fits one more batch,
# `x = [[1], [NaN]]`: worker 1's share is bad. Both workers judge the
# global gradient and skip the step; `first_bad_replica` names replica 1
# on both, and the chief (worker 0) alone saves the batch, with both
# workers' rows, into its own directory (the file's step number counts
# the steps run with `save_batches_to` set: this is the first).
#
# Here both workers run on 127.0.0.1: this script starts itself twice with
# `--worker`. On real machines, start the same script on each with its own
# `TF_CONFIG`.


# %%
def worker():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    model = one_weight_model(strategy)
    history = model.fit(one_weight_data().with_options(options), epochs=1, verbose=0, shuffle=False)
    result = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "kept": float(model.gradients["dense_0"]["kernel"].numpy()[0, 0]),
        "loss": history.history["loss"][0],
    }

    import tempfile

    saved = tempfile.mkdtemp()  # each worker's own, as on separate machines
    model.skip_bad_steps = kg.SkipBadSteps(save_batches_to=saved)
    x = np.array([[1.0], [np.nan]], dtype="float32")
    bad = tf.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(2)
    history = model.fit(bad.with_options(options), epochs=1, verbose=0, shuffle=False)
    result.update(
        skipped=history.history["skipped_steps"][0],
        weight=float(model.layers[-1].kernel.numpy()[0, 0]),
        first_bad_replica=model.first_bad_replica,
        saved=sorted(os.listdir(saved)),
    )
    if result["saved"]:
        with np.load(os.path.join(saved, result["saved"][0])) as f:
            result["saved_x"] = f["x"].ravel().tolist()
    print("RESULT " + json.dumps(result), flush=True)


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_two_workers(timeout=180):
    hosts = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if process.returncode != 0 or not lines:
                raise RuntimeError(f"A worker failed:\n{out[-2000:]}{err[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


if WORKER:
    worker()
else:
    for result in run_two_workers():
        print(f"worker {result['task']}: kept gradient {result['kept']}, loss {result['loss']}")
        print(
            f"  x = [[1], [nan]]: skipped {result['skipped']:.0f}, weight {result['weight']},"
            f" first bad replica {result['first_bad_replica']}, saved {result['saved']}"
            + (f", x in it {result['saved_x']}" if result["saved"] else "")
        )
        assert result["kept"] == 15.0 and result["loss"] == 22.5
        assert result["skipped"] == 1.0 and result["weight"] == 1.5
        assert len(result["saved"]) == (1 if result["task"] == 0 else 0)

# %% [markdown]
# ## What it costs
#
# Each replica writes its own partial gradient into its own copy of the
# slots, with no communication; reading `model.gradients` sums the copies.
# Only a gradient metric needs the global value inside the step: it reads
# the sums the optimizer's own update all-reduces anyway, where those are
# the kept gradients as they are (no clipping, loss-scale division or
# accumulation in between); otherwise the step all-reduces the kept ones
# once, whatever the number of gradient metrics. Across workers the step
# always all-reduces, so that every worker can read its gradients alone.
# Under a `LossScaleOptimizer` the replicas exchange one number per step to
# agree on skipping.
