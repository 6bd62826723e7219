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
python benchmarks/metric_overhead.py --smoke   # 2 rounds of a tiny model, for tests
python benchmarks/metric_overhead.py --jit     # with jit_compile=True
python benchmarks/metric_overhead.py --threads 1 --cpu-time  # steadiest
```

On a machine shared with other jobs, wall-clock ratios scatter by +-15%
per round; `--threads 1 --cpu-time` measures the CPU the steps use,
which other jobs disturb far less.

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
import tensorflow as tf  # noqa: E402

from keras_keepgrad import metrics as kgm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import metric_timing  # noqa: E402

TARGET = 0.02  # GradientNorm: at most 2% of a step

MODES = {
    "full": dict(
        rounds=60,
        round_seconds=0.15,
        variants=("reference", "control", "grad_norm", "per_layer", "all"),
    ),
    "quick": dict(rounds=15, round_seconds=0.05, variants=("reference", "control", "grad_norm")),
    "smoke": dict(
        rounds=2,
        round_seconds=0.01,
        variants=("reference", "control", "grad_norm", "per_layer", "all"),
        sizes=(16, 32, 16, 10),
        batch=8,
    ),
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


SIZES = (512, 1024, 512, 10)  # 1.06M parameters
BATCH = 128


def measure(mode, jit_compile, clock=time.perf_counter, log=print):
    params, steps, times = metric_timing.timed_rounds(
        gradient_metrics,
        mode["variants"],
        mode.get("sizes", SIZES),
        mode.get("batch", BATCH),
        mode["rounds"],
        mode["round_seconds"],
        jit_compile,
        clock=clock,
        log=log,
    )
    return {
        "params": params,
        "jit_compile": jit_compile,
        "steps_per_round": steps,
        "rounds": mode["rounds"],
        "variants": metric_timing.ratios(times),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="15 rounds, 3 variants")
    group.add_argument("--smoke", action="store_true", help="2 rounds of a tiny model")
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
    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
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
    print(metric_timing.table(result))
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
