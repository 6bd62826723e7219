"""What a gradient metric costs per training step (target: at most 2%).

The reference is a `kg.KeepGradModel` compiled without gradient metrics:
the metric's own cost is what `compile(metrics=[GradientNorm()])` adds on
top of keeping. Model: the ~1M-parameter MLP of `overhead.py` (512 -> 1024
-> 512 -> 10, 1.06M parameters, batch 128, Adam, sparse categorical
cross-entropy).

Paired, interleaved rounds in one process: every round times the same number
of training steps of each variant, in an order rotated by one each round, so
that slow drifts of a shared machine hit every variant alike. Each variant's
time is divided by that round's reference time; the table reports the
median of these per-round ratios, their interquartile range, and the
"overhead beyond control": the median over rounds of
`ratio(variant) - ratio(control)`, where `control` is a second reference
model (its ratio is 1 up to noise and order effects).

Variants (same initial weights, same batch):

- `reference`: `KeepGradModel`, no gradient metric.
- `control`: a second, identical reference model.
- `grad_norm`: plus `GradientNorm()` (the target of the 2% budget).
- `per_layer`: plus `GradientNorm(per_layer=True)`.
- `all`: plus every built-in (`GradientNorm`, per-layer `GradientNorm`,
  `GradientMaxAbs`, `NonFiniteGradients`, `VanishingGradients`,
  `UpdateRatio`); the full mode only.

Steps run through `model.train_function` on a pre-made iterator over a
repeated batch, after a warm-up, so tracing is excluded.

Usage:

```shell
python benchmarks/metric_overhead.py           # full: 60 rounds, ~6 min
python benchmarks/metric_overhead.py --quick   # ~1 min on 2 cores
python benchmarks/metric_overhead.py --jit     # with jit_compile=True
python benchmarks/metric_overhead.py --threads 1 --cpu-time  # steadiest
```

On a machine shared with other jobs, wall-clock ratios scatter by +-15%
per round; `--threads 1 --cpu-time` measures the CPU the steps use,
which other jobs disturb far less.

The results are in `benchmarks/README.md`.
"""

import argparse
import gc
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_keepgrad as kg  # noqa: E402
from keras_keepgrad import metrics as kgm  # noqa: E402

TARGET = 0.02  # GradientNorm: at most 2% of a step

MODES = {
    "full": dict(
        rounds=60,
        round_seconds=0.15,
        variants=("reference", "control", "grad_norm", "per_layer", "all"),
    ),
    "quick": dict(rounds=15, round_seconds=0.05, variants=("reference", "control", "grad_norm")),
}


def gradient_metrics(variant):
    if variant in ("reference", "control"):
        return []
    if variant == "grad_norm":
        return [kgm.GradientNorm()]
    if variant == "per_layer":
        return [kgm.GradientNorm(per_layer=True)]
    if variant == "all":
        return [
            kgm.GradientNorm(),
            kgm.GradientNorm(per_layer=True, name="layer_norm"),
            kgm.GradientMaxAbs(),
            kgm.NonFiniteGradients(),
            kgm.VanishingGradients(),
            kgm.UpdateRatio(),
        ]
    raise ValueError(f"Unknown variant: {variant!r}")


def build_mlp():
    # 512*1024 + 1024*512 + 512*10 (+ biases) = 1.06M parameters.
    inputs = keras.Input((512,))
    h = keras.layers.Dense(1024, activation="relu", name="dense_0")(inputs)
    h = keras.layers.Dense(512, activation="relu", name="dense_1")(h)
    return kg.KeepGradModel(inputs, keras.layers.Dense(10, name="logits")(h))


def make_variant(variant, batch, weights, jit_compile):
    model = build_mlp()
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=gradient_metrics(variant),
        jit_compile=jit_compile,
    )
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    model.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False)
    # The iterator type `fit` uses, so `train_function` is not retraced.
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
    return model, iterator


def run_steps(model, iterator, steps, clock=time.perf_counter):
    """Seconds of `clock` for `steps` training steps."""
    train_function = model.train_function
    start = clock()
    for _ in range(steps):
        logs = train_function(iterator)
    float(logs["loss"])  # the step's outputs exist: it has finished
    return clock() - start


def _summary(values):
    q25, median, q75 = np.percentile(np.asarray(values, dtype="float64"), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def measure(mode, jit_compile, clock=time.perf_counter, log=print):
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.random((128, 512), "float32")),
        tf.constant(rng.integers(0, 10, (128,)).astype("int32")),
    )
    keras.utils.set_random_seed(0)
    weights = build_mlp().get_weights()
    variants = mode["variants"]
    entries = {v: make_variant(v, batch, weights, jit_compile) for v in variants}
    for entry in entries.values():
        run_steps(*entry, 3)  # warm-up, outside the timing
    params = int(sum(np.prod(v.shape) for v in entries["reference"][0].trainable_variables))
    one = min(run_steps(*entries["reference"], 3) / 3 for _ in range(2))
    steps = max(1, int(round(mode["round_seconds"] / one)))
    log(
        f"{params:,} parameters, jit_compile={jit_compile}: {one * 1e3:.2f} ms/step "
        f"(reference), {steps} steps/round, {mode['rounds']} rounds"
    )
    times = {v: [] for v in variants}
    for r in range(mode["rounds"]):
        rotated = variants[r % len(variants) :] + variants[: r % len(variants)]
        gc.collect()
        gc.disable()
        try:
            for variant in rotated:
                times[variant].append(run_steps(*entries[variant], steps, clock) / steps)
        finally:
            gc.enable()
    reference = np.asarray(times["reference"])
    control = np.asarray(times["control"]) / reference
    results = {}
    for variant in variants:
        ratio = np.asarray(times[variant]) / reference
        results[variant] = {
            "step_ms": float(np.median(times[variant]) * 1e3),
            "ratio": _summary(ratio),
            "beyond_control": _summary(ratio - control),
        }
    return {
        "params": params,
        "jit_compile": jit_compile,
        "steps_per_round": steps,
        "rounds": mode["rounds"],
        "variants": results,
    }


def table(result):
    lines = [
        "| variant | step ms | ratio vs reference (median) | IQR | beyond control |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, r in result["variants"].items():
        ratio = r["ratio"]
        lines.append(
            f"| {variant} | {r['step_ms']:.2f} | {ratio['median']:.4f} | "
            f"{ratio['q25']:.4f}-{ratio['q75']:.4f} | "
            f"{r['beyond_control']['median']:+.4f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 rounds, 3 variants")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time (all threads) instead of the "
        "wall clock: steadier on a machine shared with other jobs",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: TensorFlow's default)",
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    mode_name = "quick" if args.quick else "full"
    clock = time.process_time if args.cpu_time else time.perf_counter
    result = measure(MODES[mode_name], args.jit, clock=clock)
    result.update(
        mode=mode_name,
        clock="cpu" if args.cpu_time else "wall",
        threads=args.threads or "default",
        versions={
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
        },
        cpus=os.cpu_count(),
    )
    print(table(result))
    cost = result["variants"]["grad_norm"]["beyond_control"]["median"]
    verdict = "within" if cost <= TARGET else "OVER"
    print(
        f"\nGradientNorm: {cost:+.2%} step time beyond control, {verdict} the {TARGET:.0%} budget."
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
