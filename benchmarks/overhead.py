"""What keeping gradients costs, measured against plain Keras.

Paired, interleaved rounds: each round times every variant (a plain
`keras.Model`, a second one as the noise control, `KeepGradModel`, ...) for
the same number of steps, in an order rotated each round, and divides each
variant's time by the plain model's time of the same round. `--processes P`
repeats the timing in P fresh processes and pools them; `--combine` pools
such runs made apart. `benchmarks/README.md` describes the method, the
variants and the results.

    python benchmarks/overhead.py --quick    # under 3 minutes on 2 cores
    python benchmarks/overhead.py --smoke    # tiny models, 2 rounds (tests)

Results are printed as Markdown tables and written as JSON to
`benchmarks/results/overhead-<mode>.json` (or `--out`), rewritten after each
measurement with `"complete": false` until the run ends. Do not edit
`keras_keepgrad/` during a run: autograph reads a function's source file
when it first traces it.
"""

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from overhead_memory import measure_memory  # noqa: E402
from overhead_memory import memory_child  # noqa: E402
from overhead_report import code_state  # noqa: E402
from overhead_report import machine_state  # noqa: E402
from overhead_report import markdown  # noqa: E402
from overhead_stats import combine_files  # noqa: E402
from overhead_stats import combine_processes  # noqa: E402
from overhead_stats import config_result  # noqa: E402
from overhead_stats import fastest_from  # noqa: E402
from overhead_stats import pass_order  # noqa: E402
from overhead_variants import OPTIMIZERS  # noqa: E402
from overhead_variants import VARIANTS  # noqa: E402
from overhead_variants import make_variant  # noqa: E402
from overhead_variants import model_specs  # noqa: E402
from overhead_variants import op_counts  # noqa: E402
from overhead_variants import run_steps  # noqa: E402
from overhead_variants import warm_up  # noqa: E402

# The most overhead beyond the control that keeping may cost, per model.
TARGETS = {"mlp_1m": 0.02, "conv": 0.02, "mlp_10m": 0.03, "embedding": 0.03}

MODES = {
    # Each round times `passes` interleaved passes over the variants, each
    # variant running about `pass_seconds` of plain training per pass.
    "full": dict(
        rounds=100,
        passes=2,
        pass_seconds=0.1,
        memory_pairs=3,
        memory_models=("mlp_10m", "embedding"),
        memory_allocators=("mmap", "default", "mmap-no-onednn"),
        memory_variants=("plain", "kept", "hand"),
    ),
    # Only the variants the targets need: building, tracing and compiling
    # each variant dominates a short run.
    "quick": dict(
        rounds=8,
        passes=2,
        pass_seconds=0.02,
        memory_pairs=1,
        memory_models=("mlp_10m",),
        variants=("plain", "control", "kept", "recompute"),
    ),
    "smoke": dict(rounds=2, passes=2, pass_seconds=0.0, memory_pairs=1, memory_models=("mlp_1m",)),
}


def time_config(name, spec, jit_compile, mode, variants, log):
    """Times one model with or without XLA: the config's results."""
    build, batch_size, make_x = spec
    rng = np.random.default_rng(0)
    x = make_x(rng, batch_size)
    y = rng.integers(0, 10, (batch_size,)).astype("int32")
    batch = (tf.constant(x), tf.constant(y))
    instances = mode.get("instances", 1)
    entries = {}
    t0 = time.perf_counter()
    keras.utils.set_random_seed(0)
    weights = keras.Model(*build()).get_weights()
    # Interleaved: instance i of every variant is built before instance i+1.
    keys = [(v, i) for i in range(instances) for v in variants]
    for variant, i in keys:
        entries[variant, i] = make_variant(
            variant, build, batch, jit_compile, weights, mode["optimizer"]
        )
    for entry in entries.values():
        warm_up(*entry)
    plain = entries["plain", 0]
    params = int(sum(np.prod(v.shape) for v in plain[0].trainable_variables))
    # Steps per pass: about `pass_seconds` of plain training.
    one = min(run_steps(*plain, 3)[0] / 3 for _ in range(2))
    steps = max(1, int(round(mode["pass_seconds"] / one)))
    log(
        f"  {name} jit={jit_compile}: {params:,} params, {instances} instance(s) "
        f"per variant built in {time.perf_counter() - t0:.1f}s, "
        f"{one * 1e3:.2f} ms/step, {steps} steps/pass"
    )
    passes = mode["passes"]
    raw = {key: np.zeros((mode["rounds"], passes, 2)) for key in keys}
    for r in range(mode["rounds"]):
        gc.collect()
        gc.disable()  # no collection inside a timed block
        try:
            for p in range(passes):
                for key in pass_order(keys, r, p, passes):
                    raw[key][r, p] = run_steps(*entries[key], steps)
        finally:
            gc.enable()
    result = {
        "model": name,
        "jit_compile": jit_compile,
        "params": params,
        "param_mb": params * 4 / 2**20,
        "batch_size": batch_size,
        "instances": instances,
        "steps_per_pass": steps,
        "passes_per_round": passes,
        "rounds": mode["rounds"],
        # [instance][round][pass] = [wall, cpu] seconds per step, before the
        # min over passes and the mean over instances.
        "pass_seconds_per_step": {
            v: [(raw[v, i] / steps).tolist() for i in range(instances)] for v in variants
        },
    }
    # A round's time of an instance: its fastest pass (see `config_result`).
    result.update(config_result([fastest_from(result)], variants, TARGETS.get(name)))
    del entries
    keras.backend.clear_session()
    gc.collect()
    return result


def child_args(argv, out):
    """The arguments of one process of `--processes`: `argv`, timing only,
    in this one process, its JSON to `out`.

    The last occurrence of an option wins, also over an abbreviation
    (`--proc 3`) that argparse accepts.
    """
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--processes", "--out"):
            skip = True
        elif not arg.startswith(("--processes=", "--out=")):
            args.append(arg)
    return args + ["--no-memory", "--no-ops", "--processes", "1", "--out", out]


def time_in_processes(argv, processes, log):
    """Runs the timing in `processes` fresh processes, one after another.

    Yields each process's results as it ends.
    """
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(processes):
            path = os.path.join(tmp, f"process-{k + 1}.json")
            log(f"process {k + 1} of {processes}:")
            # The child's tables go nowhere: its JSON has them, and the
            # parent prints the combined ones. Its log goes to stderr.
            subprocess.run(
                [sys.executable, os.path.join(HERE, "overhead.py"), *child_args(argv, path)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with open(path) as f:
                yield json.load(f)


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="8 rounds, < 3 min")
    group.add_argument("--smoke", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=_positive_int, help="override the number of rounds")
    parser.add_argument(
        "--pass-seconds",
        type=_positive_float,
        help="plain training time per pass (default by mode)",
    )
    parser.add_argument("--passes", type=_positive_int, help="passes per round")
    parser.add_argument(
        "--instances",
        type=_positive_int,
        help="model objects per variant, timed in turn and averaged (default 1)",
    )
    parser.add_argument(
        "--processes",
        type=_positive_int,
        help="time in this many fresh processes, one after "
        "another, and pool their rounds: with several, the "
        "interval covers what differs between processes "
        "(default 1)",
    )
    parser.add_argument("--models", nargs="+", help="only these models")
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adam",
        help="optimizer of every variant (default adam)",
    )
    parser.add_argument(
        "--jit",
        choices=("off", "on", "both"),
        help="jit_compile off, on or both; default both (smoke: off)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        help="only these variants (plain and control always run)",
    )
    parser.add_argument("--batch-size", type=int, help="override every model's batch size")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-ops", action="store_true")
    parser.add_argument("--out", help="JSON path; default benchmarks/results/")
    parser.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="time nothing: pool the processes of earlier "
        "--processes runs' JSON files (their common configs)",
    )
    parser.add_argument(
        "--memory-child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child, args.smoke, args.steps, args.optimizer)
        return None
    if args.combine:
        results = combine_files(args.combine)
        results["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
        out = args.out or os.path.join(ROOT, "benchmarks", "results", "overhead-combined.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(markdown(results))
        return results

    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = dict(MODES[mode_name], optimizer=args.optimizer)
    if args.rounds:
        mode["rounds"] = args.rounds
    if args.instances:
        mode["instances"] = args.instances
    if args.pass_seconds is not None:
        mode["pass_seconds"] = args.pass_seconds
    if args.passes:
        mode["passes"] = args.passes
    variants = list(args.variants or mode.get("variants", VARIANTS))
    variants = ["plain", "control"] + [v for v in variants if v not in ("plain", "control")]
    specs = model_specs(args.smoke)
    if args.batch_size:
        specs = {k: (b, args.batch_size, x) for k, (b, _, x) in specs.items()}
    names = args.models or list(specs)
    jit = args.jit or ("off" if args.smoke else "both")
    jits = {"off": [False], "on": [True], "both": [False, True]}[jit]

    # One trace per model and iterator type is expected; TensorFlow's
    # "excessive retracing" warning counts them across models.
    tf.get_logger().setLevel("ERROR")

    def log(message):
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    results = {
        "mode": mode_name,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine_before": machine_state(),
        "code": code_state(),
        "variants": variants,
        "optimizer": args.optimizer,
        "configs": [],
        "op_counts": [],
        "memory": [],
    }
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"overhead-{mode_name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def save(complete=False):
        # After every measurement: a failure later (or an interrupted run)
        # keeps what was measured, marked incomplete.
        results["complete"] = complete
        results["seconds"] = time.perf_counter() - started
        with open(out + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(out + ".tmp", out)

    log(f"mode={mode_name}, rounds={mode['rounds']}, optimizer={args.optimizer}")
    if args.no_timing:
        pass
    elif args.processes and args.processes > 1:
        # Saved after each process: an interrupted run keeps what it measured.
        results["process_runs"] = []
        argv = sys.argv[1:] if argv is None else list(argv)
        for run in time_in_processes(argv, args.processes, log):
            results["process_runs"].append(run)
            save()
        results["configs"] = combine_processes(results["process_runs"])
        save()
    else:
        for name in names:
            for jit_compile in jits:
                results["configs"].append(
                    time_config(name, specs[name], jit_compile, mode, variants, log)
                )
                save()
    log(f"  timing done at {time.perf_counter() - started:.0f}s")
    if not args.no_ops:
        for name in names:
            results["op_counts"].append(op_counts(name, specs[name], args.optimizer))
        save()
        log(f"  op counts done at {time.perf_counter() - started:.0f}s")
    if not args.no_memory:
        for allocator in mode.get("memory_allocators", ("mmap",)):
            for name in mode["memory_models"]:
                if name in specs:
                    results["memory"].append(
                        measure_memory(
                            name,
                            mode["memory_pairs"],
                            args.smoke,
                            log,
                            allocator,
                            mode.get("memory_variants", ("plain", "kept")),
                            args.optimizer,
                        )
                    )
                    save()
    results["machine_after"] = machine_state()
    save(complete=True)

    table = markdown(results)
    print(table)
    log(f"wrote {out} in {results['seconds']:.0f}s; load now {os.getloadavg()}")
    return results


if __name__ == "__main__":
    main()
