"""What each training-dynamics metric costs per step (target: at most 3%).

The reference is a `kg.KeepGradModel` compiled without gradient metrics:
a metric's own cost is what `compile(metrics=[...])` adds on top of
keeping, with the metric computed on every step. Model: the ~1M-parameter
MLP of `metric_overhead.py` (512 -> 1024 -> 512 -> 10, 1.06M parameters,
batch 128, Adam, sparse categorical cross-entropy), on one device, where
`GradientNoiseScale` and `GradientSNR` accumulate the last k = 4 steps'
gradients in one parameter-sized float32 buffer.

Paired, interleaved rounds in one process, as in `metric_overhead.py`:
every round times the same number of training steps of each variant, in an
order rotated by one each round; each variant's time is divided by that
round's reference time. The table reports the median of these ratios,
their interquartile range, and the overhead beyond control: the median
over rounds of `ratio(variant) - ratio(control)`, where `control` is a
second reference model.

Variants (same initial weights, same batch):

- `reference`, `control`: `KeepGradModel`, no gradient metric.
- `grad_norm`: `GradientNorm()`, for scale.
- `noise_scale`: `GradientNoiseScale()`.
- `snr`: `GradientSNR()` (per layer).
- `cosine`: `GradientCosine()`.
- `cosine_per_layer`: `GradientCosine(per_layer=True)`.
- `floor_window`: the least an accumulation window can do per step, as a
  bare gradient metric: the step's sums of squares (shared with
  `GradientNorm`) and an `assign_add` of every gradient into a
  parameter-sized float32 buffer (read the gradient and the buffer, write
  the buffer). The floor of `noise_scale` and `snr` on one device.
- `floor_dot`: the least the cosine can do per step: the sums of squares,
  `reduce_sum(g * h)` of every gradient with its copy from the previous
  step (the fastest dot product of two parameter-sized tensors found
  without XLA; `tf.tensordot`, `tf.linalg.matvec`, `tf.einsum` and an
  XLA-compiled function are slower on CPU), and the copy itself (an
  assignment, which shares the gradient's buffer). The floor of `cosine`.

Usage:

```shell
python benchmarks/dynamics_overhead.py           # 150 rounds, ~6 min on 2 cores
python benchmarks/dynamics_overhead.py --quick   # 10 rounds
python benchmarks/dynamics_overhead.py --smoke   # 2 rounds of a tiny model, for tests
python benchmarks/dynamics_overhead.py --threads 1 --cpu-time  # steadiest
python benchmarks/dynamics_overhead.py --mirrored  # 2 replicas on 2 logical CPUs
```

With `--mirrored` the batch of 128 is split over 2 replicas, which are the
small batches of `GradientNoiseScale` and `GradientSNR` (no accumulation
buffer); the reference is a `KeepGradModel` under the same strategy.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead_stats import _summary  # noqa: E402
from overhead_stats import median_interval  # noqa: E402

TARGET = 0.03  # each statistic: at most 3% of a step beyond keeping
VARIANTS = (
    "reference",
    "control",
    "grad_norm",
    "noise_scale",
    "snr",
    "cosine",
    "cosine_per_layer",
    "floor_window",
    "floor_dot",
)
STATISTICS = ("noise_scale", "snr", "cosine", "cosine_per_layer")
FLOORS = {
    "noise_scale": "floor_window",
    "snr": "floor_window",
    "cosine": "floor_dot",
    "cosine_per_layer": "floor_dot",
}
MODES = {
    "full": dict(rounds=150, round_seconds=0.15, sizes=(512, 1024, 512, 10), batch=128),
    "quick": dict(rounds=10, round_seconds=0.1, sizes=(512, 1024, 512, 10), batch=128),
    "smoke": dict(rounds=2, round_seconds=0.01, sizes=(16, 32, 16, 10), batch=8),
}


class _Floor(kgm.GradientMetric):
    """The raw parameter-sized work of a statistic, without its arithmetic."""

    def __init__(self, kind):
        super().__init__(fn=None, name=kind)
        self.kind = kind
        self._buffers = None

    def _step_values(self, grads):
        from keras_keepgrad import _dynamics
        from keras_keepgrad import _stats

        dense = {p: tf.cast(g, tf.float32) for p, g in grads.items()}
        if self._buffers is None:
            self._buffers = _dynamics._create(
                lambda: {p: _dynamics._local_variable(tf.zeros(g.shape)) for p, g in dense.items()}
            )
        value = tf.cast(tf.reduce_sum(_stats.shared_squares(grads)), tf.float32)
        if self.kind == "floor_window":
            for p, g in dense.items():
                self._buffers[p].assign_add(g, read_value=False)
        else:
            held = {p: tf.convert_to_tensor(b) for p, b in self._buffers.items()}
            value += tf.add_n([tf.reduce_sum(g * held[p]) for p, g in dense.items()])
            for p, g in dense.items():
                self._buffers[p].assign(g, read_value=False)
        return {self.name: value}


def gradient_metrics(variant):
    if variant.startswith("floor_"):
        return [_Floor(variant)]
    return {
        "reference": [],
        "control": [],
        "grad_norm": [kgm.GradientNorm()],
        "noise_scale": [kgm.GradientNoiseScale()],
        "snr": [kgm.GradientSNR()],
        "cosine": [kgm.GradientCosine()],
        "cosine_per_layer": [kgm.GradientCosine(per_layer=True)],
    }[variant]


def build_mlp(sizes):
    inputs = keras.Input((sizes[0],))
    h = inputs
    for i, units in enumerate(sizes[1:-1]):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    return kg.KeepGradModel(inputs, keras.layers.Dense(sizes[-1], name="logits")(h))


def make_variant(variant, sizes, batch, weights, jit_compile, strategy):
    with strategy.scope():
        model = build_mlp(sizes)
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


def measure(mode, jit_compile, clock=time.perf_counter, log=print, strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    sizes = mode["sizes"]
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.random((mode["batch"], sizes[0]), "float32")),
        tf.constant(rng.integers(0, sizes[-1], (mode["batch"],)).astype("int32")),
    )
    keras.utils.set_random_seed(0)
    weights = build_mlp(sizes).get_weights()
    entries = {v: make_variant(v, sizes, batch, weights, jit_compile, strategy) for v in VARIANTS}
    for entry in entries.values():
        run_steps(*entry, 3)  # warm-up, outside the timing
    params = int(sum(np.prod(v.shape) for v in entries["reference"][0].trainable_variables))
    one = min(run_steps(*entries["reference"], 3) / 3 for _ in range(2))
    steps = max(1, int(round(mode["round_seconds"] / one)))
    log(
        f"{params:,} parameters, jit_compile={jit_compile}, "
        f"{strategy.num_replicas_in_sync} replica(s): {one * 1e3:.2f} ms/step "
        f"(reference), {steps} steps/round, {mode['rounds']} rounds"
    )
    times = {v: [] for v in VARIANTS}
    for r in range(mode["rounds"]):
        rotated = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
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
    for variant in VARIANTS:
        ratio = np.asarray(times[variant]) / reference
        results[variant] = {
            "step_ms": float(np.median(times[variant]) * 1e3),
            "ratio": _summary(ratio),
            "beyond_control": _summary(ratio - control),
        }
    for variant in STATISTICS:
        if variant in times and FLOORS[variant] in times:
            # Paired in each round, as the ratios are.
            beyond = (np.asarray(times[variant]) - np.asarray(times[FLOORS[variant]])) / reference
            results[variant]["beyond_floor"] = dict(
                _summary(beyond), ci90=median_interval(beyond, 0.90)
            )
    return {
        "params": params,
        "jit_compile": jit_compile,
        "replicas": strategy.num_replicas_in_sync,
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


def verdict(result, variant):
    """One line: `variant`'s cost against the budget and against its floor."""
    entry = result["variants"][variant]
    cost = entry["beyond_control"]["median"]
    floor = FLOORS[variant]
    beyond = entry["beyond_floor"]
    ci = beyond["ci90"]
    # Within noise of the floor where the interval of the median holds 0.
    where = (
        "above its floor"
        if ci["low"] > 0
        else "below its floor"
        if ci["high"] < 0
        else "at its floor (within noise)"
    )
    return (
        f"{variant}: {cost:+.2%} step time beyond control, "
        f"{'within' if cost <= TARGET else 'OVER'} the {TARGET:.0%} budget; "
        f"{beyond['median']:+.2%} beyond {floor} "
        f"({result['variants'][floor]['beyond_control']['median']:+.2%}), "
        f"interval of that median [{ci['low']:+.2%}, {ci['high']:+.2%}] "
        f"(coverage {ci['coverage']:.0%}): {where}."
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="10 rounds")
    group.add_argument("--smoke", action="store_true", help="2 rounds of a tiny model")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (0: the mode's)")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    parser.add_argument(
        "--mirrored",
        action="store_true",
        help="MirroredStrategy on 2 logical CPUs: the replicas are the small batches",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time (all threads) instead of the wall clock",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: TensorFlow's default)",
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    strategy = None
    if args.mirrored:
        # Before TensorFlow runs any op, which fixes its devices.
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    clock = time.process_time if args.cpu_time else time.perf_counter
    mode = dict(MODES[mode_name])
    if args.rounds:
        mode["rounds"] = args.rounds
    result = measure(mode, args.jit, clock=clock, strategy=strategy)
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
    print()
    for variant in STATISTICS:
        print(verdict(result, variant))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
