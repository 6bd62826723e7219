"""Watching every batch: the gradient callbacks and metrics against plain Keras.

What a user debugging a divergence runs, paired with what plain Keras
costs with its own TensorBoard writing every batch:

- `keras`: a plain `keras.Model` with
  `keras.callbacks.TensorBoard(update_freq=1, histogram_freq=1)`.
- `kept`: the same layers as a `KeepGradModel`, same callback: what keeping
  the gradients costs by itself.
- `all`: the `KeepGradModel` with `GradientTensorBoard(update_freq=1,
  histogram_freq=1)`, `GradientMonitor(check_freq=1)` and the metrics
  `GradientNorm()` and `GradientNorm(per_layer=True)`: every batch checked,
  charted and logged.

Two models: the tiny MLP (32 inputs, two ReLU layers of 64, one output,
batch 64, MSE) and the ~1M-parameter MLP of `tensorboard_overhead.py`
(512 -> 1024 -> 512 -> 10, batch 128). Adam, one repeated in-memory batch,
`verbose=0`. Each round runs one `fit` per variant in a rotated order, with
a fresh callback and log directory each; the ratio of a variant is its
training time (`on_train_begin` to `on_train_end`) over the same round's
`keras` time, reported as the median over rounds [interquartile range],
for wall time and for this process's CPU time.
The targets: `all / keras` at most 1.30 on the tiny MLP and 1.10 on the 1M
MLP. A warm-up `fit` per variant excludes tracing and the first writers.

Usage:

```shell
python benchmarks/per_batch_overhead.py            # 5 rounds of 2 x 1000 steps, ~8 min
python benchmarks/per_batch_overhead.py --rounds 3 --steps 100
python benchmarks/per_batch_overhead.py --smoke    # seconds; numbers are noise
```
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead_stats import quartiles  # noqa: E402

VARIANTS = ("keras", "kept", "all")
TARGETS = {"tiny": 1.30, "mlp_1m": 1.10}
MODELS = {
    # name: (inputs, hidden units, outputs, batch, loss)
    "tiny": (32, (64, 64), 1, 64, "mse"),
    "mlp_1m": (512, (1024, 512), 10, 128, "sparse"),
}
SMOKE_MODELS = {
    "tiny": (8, (4,), 1, 4, "mse"),
    "mlp_1m": (16, (32,), 10, 4, "sparse"),
}


def build(spec, kept):
    n_in, hidden, n_out, _, loss = spec
    keras.utils.set_random_seed(0)
    inputs = keras.Input((n_in,))
    h = inputs
    for i, units in enumerate(hidden):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(n_out, name="out")(h)
    cls = kg.KeepGradModel if kept else keras.Model
    model = cls(inputs, outputs)
    metrics = None
    if kept == "all":
        metrics = [kg.metrics.GradientNorm(), kg.metrics.GradientNorm(per_layer=True)]
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            if loss == "sparse"
            else "mse"
        ),
        metrics=metrics,
    )
    return model


def dataset(spec):
    n_in, _, n_out, batch, loss = spec
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, n_in), dtype="float32"))
    if loss == "sparse":
        y = tf.constant(rng.integers(0, n_out, (batch,)).astype("int32"))
    else:
        y = tf.constant(rng.random((batch, n_out), dtype="float32"))
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def callbacks_for(variant, log_dir):
    if variant in ("keras", "kept"):
        return [keras.callbacks.TensorBoard(log_dir, update_freq=1, histogram_freq=1)]
    return [
        kg.callbacks.GradientTensorBoard(log_dir, update_freq=1, histogram_freq=1),
        kg.callbacks.GradientMonitor(check_freq=1),
    ]


class _Clock(keras.callbacks.Callback):
    def __init__(self, state, key):
        super().__init__()
        self.state, self.key = state, key

    def on_train_begin(self, logs=None):
        if self.key == "begin":
            self.state["begin"] = (time.perf_counter(), time.process_time())

    def on_train_end(self, logs=None):
        if self.key == "end":
            self.state["end"] = (time.perf_counter(), time.process_time())


def time_fit(model, data, variant, log_dir, steps, epochs):
    state = {}
    callbacks = [_Clock(state, "begin"), *callbacks_for(variant, log_dir), _Clock(state, "end")]
    model.fit(
        data,
        steps_per_epoch=steps,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    # Wall seconds, and this process's CPU seconds (less moved by other
    # jobs on a shared machine than wall time).
    return tuple(end - begin for begin, end in zip(state["begin"], state["end"]))


def check_written(log_dir, model):
    """`all` really wrote and logged every batch (not a silent no-op)."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "train"), size_guidance={"tensors": 0}
    )
    acc.Reload()
    tags = acc.Tags()["tensors"]
    assert "gradients/global_norm" in tags, tags
    assert "batch_grad_norm" in tags, tags


def run(name, spec, rounds, steps, epochs, root):
    data = dataset(spec)
    models = {
        "keras": build(spec, kept=False),
        "kept": build(spec, kept=True),
        "all": build(spec, kept="all"),
    }
    params = sum(int(np.prod(v.shape)) for v in models["keras"].trainable_variables)
    for variant in VARIANTS:  # warm-up: tracing, first writers
        log_dir = os.path.join(root, name, "warmup", variant)
        time_fit(models[variant], data, variant, log_dir, steps, epochs)
        if variant == "all":
            check_written(log_dir, models[variant])
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        gc.collect()
        gc.disable()
        try:
            for variant in order:
                log_dir = os.path.join(root, name, f"round{r}", variant)
                times[variant].append(
                    time_fit(models[variant], data, variant, log_dir, steps, epochs)
                )
        finally:
            gc.enable()
        shutil.rmtree(os.path.join(root, name, f"round{r}"), ignore_errors=True)
    result = {
        "model": name,
        "params": params,
        "batch": spec[3],
        "rounds": rounds,
        "steps": steps * epochs,
        "ratios": {},
        "cpu_ratios": {},
        "seconds": {v: [t[0] for t in times[v]] for v in VARIANTS},
        "cpu_seconds": {v: [t[1] for t in times[v]] for v in VARIANTS},
    }
    for key, measure in (("ratios", "seconds"), ("cpu_ratios", "cpu_seconds")):
        base = np.asarray(result[measure]["keras"])
        for variant in VARIANTS:
            result[key][variant] = quartiles(np.asarray(result[measure][variant]) / base)
    result["keras_ms_per_step"] = (
        float(np.median(result["seconds"]["keras"])) / (steps * epochs) * 1e3
    )
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--models", default="tiny,mlp_1m")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    specs = SMOKE_MODELS if args.smoke else MODELS
    rounds, steps, epochs = (2, 3, 2) if args.smoke else (args.rounds, args.steps, args.epochs)
    root = tempfile.mkdtemp(prefix="per_batch_")
    results = []
    try:
        for name in args.models.split(","):
            results.append(run(name, specs[name], rounds, steps, epochs, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{rounds} rounds of {epochs} x {steps} steps; {os.cpu_count()} CPUs, "
        f"TF {tf.__version__}, Keras {keras.__version__}. Ratio: training time over "
        "the same round's `keras` (plain model, keras TensorBoard(update_freq=1, "
        "histogram_freq=1)), median [IQR]."
    )
    print()
    print(
        "| model | params | batch | keras ms/step | kept / keras | all / keras "
        "| all / keras, CPU time | target |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def cell(ratio):
        return f"{ratio['median']:.3f} [{ratio['q25']:.3f}, {ratio['q75']:.3f}]"

    for r in results:
        target = TARGETS[r["model"]]
        met = "met" if r["ratios"]["all"]["median"] <= target else "NOT met"
        print(
            f"| {r['model']} | {r['params']:,} | {r['batch']} | "
            f"{r['keras_ms_per_step']:.2f} | {cell(r['ratios']['kept'])} | "
            f"{cell(r['ratios']['all'])} | {cell(r['cpu_ratios']['all'])} | "
            f"<= {target:.2f} (wall): {met} |"
        )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    if load:
        print(f"\nLoad average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"smoke": args.smoke, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
