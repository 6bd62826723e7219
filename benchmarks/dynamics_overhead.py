"""What each training-dynamics metric costs per step (target: at most 3%).

The reference is a `kg.KeepGradModel` compiled without gradient metrics:
a metric's own cost is what `compile(metrics=[...])` adds on top of
keeping, with the metric computed on every step. Model: the ~1M-parameter
MLP of `metric_overhead.py` (512 -> 1024 -> 512 -> 10, 1.06M parameters,
batch 128, Adam, sparse categorical cross-entropy), on one device, where
`GradientNoiseScale` and `GradientSNR` accumulate the last k = 4 steps'
gradients in one parameter-sized float32 buffer.

Paired, interleaved rounds in one process (`metric_timing.py`, shared with
`metric_overhead.py`): every round times the same number of training steps
of each variant, in an order rotated by one each round; each variant's time
is divided by that round's reference time. The table reports the median of
these ratios, their interquartile range, and the overhead beyond control:
the median over rounds of `ratio(variant) - ratio(control)`, where
`control` is a second reference model. Each statistic is also timed
beside its floor: the median over rounds of `(time(statistic) -
time(floor)) / time(reference)`, with a distribution-free 90% interval of
that median. A variant's cost moves between processes by more than that
interval, so `--pool` combines the `--out` files of several processes,
judging by the processes' medians.

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
- `floor_replicas`, with `--mirrored` only: the sums of squares of the
  global gradient and of each replica's partial gradient, and one
  all-reduce of a scalar. The floor of `noise_scale` and `snr` there.

Usage:

```shell
python benchmarks/dynamics_overhead.py           # 150 rounds, ~6 min on 2 cores
python benchmarks/dynamics_overhead.py --quick   # 10 rounds
python benchmarks/dynamics_overhead.py --smoke   # 2 rounds of a tiny model, for tests
python benchmarks/dynamics_overhead.py --threads 1 --cpu-time  # steadiest
python benchmarks/dynamics_overhead.py --mirrored  # 2 replicas on 2 logical CPUs
python benchmarks/dynamics_overhead.py --pool run1.json run2.json ...  # time nothing
```

With `--mirrored` the batch of 128 is split over 2 replicas, which are the
small batches of `GradientNoiseScale` and `GradientSNR` (no accumulation
buffer); the reference is a `KeepGradModel` under the same strategy.

The results are in `benchmarks/README.md`.
"""

import argparse
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

from keras_keepgrad import metrics as kgm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import metric_timing  # noqa: E402
from overhead_stats import median_interval  # noqa: E402
from overhead_stats import quartiles  # noqa: E402

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
# With replicas in the process the noise scale and the SNR use no window:
# their least work is the replicas' own squared norms and one all-reduce.
MIRRORED_FLOORS = dict(FLOORS, noise_scale="floor_replicas", snr="floor_replicas")


def variants_for(replicas):
    """The variants timed with this many replicas in the process."""
    return VARIANTS + ("floor_replicas",) if replicas > 1 else VARIANTS


def floors_for(replicas):
    return MIRRORED_FLOORS if replicas > 1 else FLOORS


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
        from keras_keepgrad import _capture
        from keras_keepgrad import _dynamics
        from keras_keepgrad import _stats

        dense = {p: tf.cast(g, tf.float32) for p, g in grads.items()}
        if self._buffers is None:
            self._buffers = _dynamics._create(
                lambda: {p: _dynamics._local_variable(tf.zeros(g.shape)) for p, g in dense.items()}
            )
        value = tf.cast(tf.reduce_sum(_stats.shared_squares(grads)), tf.float32)
        if self.kind == "floor_replicas":
            # Each replica's partial gradient's squared norm, summed over
            # the replicas in one all-reduce of a scalar.
            partial = _capture.current_step().grads
            local = tf.add_n([tf.nn.l2_loss(tf.cast(g, tf.float32)) for g in partial.values()])
            context = tf.distribute.get_replica_context()
            return {self.name: value + context.all_reduce(tf.distribute.ReduceOp.SUM, local)}
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


def measure(mode, jit_compile, clock=time.perf_counter, log=print, strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    floors = floors_for(replicas)
    params, steps, times = metric_timing.timed_rounds(
        gradient_metrics,
        variants_for(replicas),
        mode["sizes"],
        mode["batch"],
        mode["rounds"],
        mode["round_seconds"],
        jit_compile,
        clock=clock,
        log=log,
        strategy=strategy,
    )
    results = metric_timing.ratios(times)
    reference = np.asarray(times["reference"])
    for variant in STATISTICS:
        floor = floors[variant]
        # Paired in each round, as the ratios are.
        beyond = (np.asarray(times[variant]) - np.asarray(times[floor])) / reference
        results[variant]["beyond_floor"] = dict(
            quartiles(beyond), floor=floor, ci90=median_interval(beyond, 0.90)
        )
    return {
        "params": params,
        "jit_compile": jit_compile,
        "replicas": replicas,
        "steps_per_round": steps,
        "rounds": mode["rounds"],
        "variants": results,
    }


def _against_floor(interval):
    """Where an interval of a median beyond the floor puts a statistic."""
    if interval["low"] > 0:
        return "above its floor"
    if interval["high"] < 0:
        return "below its floor"
    return "at its floor (within noise)"


def _against_budget(interval):
    """As `overhead_stats.intervals`: met when the whole interval is within."""
    if interval["high"] <= TARGET:
        return "met"
    return "missed" if interval["low"] > TARGET else "undecided"


def verdict(result, variant):
    """One line: `variant`'s cost against the budget and against its floor."""
    entry = result["variants"][variant]
    cost = entry["beyond_control"]["median"]
    beyond = entry["beyond_floor"]
    floor = beyond["floor"]
    ci = beyond["ci90"]
    return (
        f"{variant}: {cost:+.2%} step time beyond control, "
        f"{'within' if cost <= TARGET else 'OVER'} the {TARGET:.0%} budget; "
        f"{beyond['median']:+.2%} beyond {floor} "
        f"({result['variants'][floor]['beyond_control']['median']:+.2%}), "
        f"interval of that median [{ci['low']:+.2%}, {ci['high']:+.2%}] "
        f"(coverage {ci['coverage']:.0%}): {_against_floor(ci)}."
    )


def _over_processes(values):
    return {
        "per_process": [float(v) for v in values],
        "median": float(np.median(values)),
        "interval": median_interval(values, 0.90),
    }


def pool(results):
    """Every variant and statistic over several processes' `--out` results.

    A variant's cost differs between processes by more than the rounds of
    one process vary (each process makes its own models and buffers), so
    the samples here are the processes' medians: their median, and the
    distribution-free interval of it (`median_interval`; with 5 processes
    their range, at coverage 1 - 2 / 32).

    Returns:
        `{"processes", "beyond_control": {variant: ...}, "statistics":
        {statistic: ...}}`, each statistic with its floor, its cost beyond
        the floor and the verdicts on the budget and against the floor.

    Raises:
        ValueError: `results` is empty, or its runs differ in mode,
            replicas, clock, threads, variants or the floor of a statistic.
    """
    if not results:
        raise ValueError("`results` must hold at least one run. Received: []")
    for key in ("mode", "replicas", "clock", "threads"):
        seen = sorted({str(r.get(key)) for r in results})
        if len(seen) > 1:
            raise ValueError(
                f"The runs to pool must share their `{key}`. Received: {', '.join(seen)}"
            )
    variants = list(results[0]["variants"])
    for r in results:
        if list(r["variants"]) != variants:
            raise ValueError(
                "The runs to pool must time the same variants. Received: "
                f"{variants} and {list(r['variants'])}"
            )
    costs = {
        v: _over_processes([r["variants"][v]["beyond_control"]["median"] for r in results])
        for v in variants
    }
    statistics = {}
    for variant in STATISTICS:
        entries = [r["variants"][variant] for r in results]
        floors = sorted({e["beyond_floor"]["floor"] for e in entries})
        if len(floors) > 1:
            raise ValueError(
                f"The runs to pool time {variant} against different floors: {', '.join(floors)}"
            )
        beyond = _over_processes([e["beyond_floor"]["median"] for e in entries])
        statistics[variant] = {
            "floor": floors[0],
            "beyond_floor": beyond,
            "budget": _against_budget(costs[variant]["interval"]),
            "against_floor": _against_floor(beyond["interval"]),
        }
    return {"processes": len(results), "beyond_control": costs, "statistics": statistics}


def pool_table(pooled):
    def cell(entry):
        ci = entry["interval"]
        return f"{entry['median']:+.1%} [{ci['low']:+.1%}, {ci['high']:+.1%}]"

    costs = pooled["beyond_control"]
    lines = ["| variant | beyond keeping |", "|---|---:|"]
    lines += [f"| {v} | {cell(c)} |" for v, c in costs.items()]
    lines += [
        "",
        "| statistic | its floor | statistic beyond floor | 3% budget | against the floor |",
        "|---|---|---:|---|---|",
    ]
    for variant, p in pooled["statistics"].items():
        lines.append(
            f"| {variant} | {p['floor']} | {cell(p['beyond_floor'])} | "
            f"{p['budget']} | {p['against_floor']} |"
        )
    coverage = next(iter(costs.values()))["interval"]["coverage"]
    lines += [
        "",
        f"Medians over {pooled['processes']} processes, with the interval of "
        f"each median (coverage {coverage:.1%}).",
    ]
    return "\n".join(lines)


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
    parser.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="time nothing: pool the --out files of several runs (one per process)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 0:
        parser.error(f"--rounds must be 0 (the mode's) or more. Received: {args.rounds}")
    if args.pool:
        results = []
        for path in args.pool:
            with open(path) as f:
                result = json.load(f)
            variants = result.get("variants") if isinstance(result, dict) else None
            if not isinstance(variants, dict) or not all(
                "beyond_floor" in variants.get(s, {}) for s in STATISTICS
            ):
                parser.error(
                    f"--pool takes the --out files of dynamics_overhead.py runs; "
                    f"{path} holds no statistic beside its floor. Rerun "
                    "dynamics_overhead.py with --out for it."
                )
            results.append(result)
        pooled = pool(results)
        print(pool_table(pooled))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(pooled, f, indent=2)
        return
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
    print(metric_timing.table(result))
    print()
    for variant in STATISTICS:
        print(verdict(result, variant))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
