"""What keeping gradients, gradient metrics and callbacks cost, against plain Keras.

Every subcommand times its variants in paired, interleaved rounds in one
process: each round runs every variant for the same number of steps, in an
order rotated each round, and divides each variant's time by the same
round's time of the base (a plain `keras.Model`, or for the metrics a
`KeepGradModel` without them); a second base model is the noise control.
`benchmarks/README.md` describes the method, the variants and the results.

    python benchmarks/run.py keeping --quick      # KeepGradModel against keras.Model
    python benchmarks/run.py keeping --backend jax
    python benchmarks/run.py memory               # peak RSS, fresh processes
    python benchmarks/run.py metrics              # GradientNorm and the built-ins
    python benchmarks/run.py dynamics             # noise scale, SNR, cosine, floors
    python benchmarks/run.py tensorboard --backend all   # watching every batch
    python benchmarks/run.py pool a.json b.json   # pool runs made apart

Each takes `--smoke` (tiny models, 2 rounds: checks that every number is
computed) and `--quick`, and `--processes P` (time in P fresh processes, one
after another, and pool their rounds). Results are printed as Markdown and
written as JSON to `benchmarks/results/<subcommand>-<mode>.json` (or
`--out`). Do not edit `keras_keepgrad/` during a run: autograph reads a
function's source file when it first traces it.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BACKENDS = ("tensorflow", "jax", "torch")
# The most overhead beyond the control that keeping may cost, per model.
KEEPING_TARGETS = {"mlp_1m": 0.02, "conv": 0.02, "mlp_10m": 0.03, "embedding": 0.03}
# A target below what the hardware allows is judged against the floor
# measured in the same run: met within noise of it (keeping), or within
# about 3 points of it (each dynamics statistic).
KEEPING_TOLERANCE, DYNAMICS_TOLERANCE = 0.0, 0.03
METRICS_TARGET, DYNAMICS_TARGET = 0.02, 0.03
WATCH_TARGETS = {"mlp_6k": 0.30, "mlp_1m": 0.10}
# rounds, passes per round, seconds of base training per pass.
MODES = {
    "keeping": {"full": (100, 2, 0.1), "quick": (8, 2, 0.02), "smoke": (2, 2, 0.0)},
    "metrics": {"full": (60, 1, 0.15), "quick": (15, 1, 0.05), "smoke": (2, 1, 0.01)},
    "dynamics": {"full": (150, 1, 0.15), "quick": (10, 1, 0.1), "smoke": (2, 1, 0.01)},
}


def log(message):
    print(message, file=sys.stderr, flush=True)


# --- timing -------------------------------------------------------------


def time_rounds(runners, rounds, passes, steps):
    """`{variant: array [rounds, measures]}` of `runners` in paired rounds.

    `runners[variant, instance](steps)` runs `steps` steps and returns its
    measures per step. A round's value of an instance is its fastest pass
    (other processes only ever add time); a variant's is the mean over its
    instances, which averages out what makes one model object persistently
    faster or slower than an identical one.
    """
    import numpy as np
    import stats

    keys = list(runners)
    fastest = {k: [] for k in keys}
    for r in range(rounds):
        found = {k: [] for k in keys}
        gc.collect()
        gc.disable()  # no collection inside a timed block
        try:
            for p in range(passes):
                for key in stats.pass_order(keys, r, p, passes):
                    found[key].append(runners[key](steps))
        finally:
            gc.enable()
        for k in keys:
            fastest[k].append(np.min(found[k], axis=0))
    variants = dict.fromkeys(v for v, _ in keys)
    return {v: np.mean([fastest[k] for k in keys if k[0] == v], axis=0).tolist() for v in variants}


def tf_runner(model, callback, batch):
    """Steps through `model.train_function` on an iterator over `batch`."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensors(tuple(tf.constant(a) for a in batch)).repeat()
    callbacks = [callback] if callback else None
    model.fit(dataset, steps_per_epoch=2, shuffle=False, verbose=0, callbacks=callbacks)
    # The iterator type `fit` uses, so `train_function` is not retraced.
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))

    def run(steps):
        train_function = model.train_function
        start, start_cpu = time.perf_counter(), time.process_time()
        for step in range(steps):
            logs = train_function(iterator)
            if callback is not None:
                callback.on_train_batch_end(step, logs)
        float(logs["loss"])  # the step's outputs exist: it has finished
        return [(time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps]

    return run


def fit_runner(model, spec, steps):
    """Steps through `model.fit` on `steps` batches (JAX and PyTorch)."""
    import keras
    from models import batch_of

    x, y = batch_of(spec, spec.batch_size * steps)

    def run(n):
        start, start_cpu = time.perf_counter(), time.process_time()
        end = n * spec.batch_size
        model.fit(x[:end], y[:end], batch_size=spec.batch_size, shuffle=False, verbose=0)
        if keras.backend.backend() == "jax":
            import jax

            # Dispatch is asynchronous on JAX; PyTorch's CPU ops are not.
            jax.block_until_ready([v.value for v in model.trainable_variables])
        return [(time.perf_counter() - start) / n, (time.process_time() - start_cpu) / n]

    return run


def calibrate(run, pass_seconds):
    """Steps per pass: about `pass_seconds` of the base's training."""
    one = min(run(3)[0] for _ in range(2))
    return max(1, int(round(pass_seconds / one)))


def initial_weights(spec):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Model(*spec.build()).get_weights()


def params_of(model):
    import numpy as np

    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def config(runs, base, name, spec, params, **extra):
    """A config's JSON: what was timed, its raw rounds and their summary."""
    import stats

    summary_args = {
        k: extra.pop(k) for k in ("pairs", "targets", "tolerance", "measures") if k in extra
    }
    result = dict(model=name, params=params, batch_size=spec.batch_size, base=base, **extra)
    result.update(summary_args, runs=runs)
    result.update(stats.summarize(runs, base, **summary_args))
    return result


# --- subcommands --------------------------------------------------------


def keeping(args, specs, mode):
    """`KeepGradModel` against `keras.Model`, and against what else keeps."""
    import keras
    from models import KEEPING
    from models import keeping_model

    backend = keras.backend.backend()
    rounds, passes, pass_seconds = mode
    variants = args.variants or (
        ("plain", "control", "kept", "recompute") if args.quick else KEEPING
    )
    if backend != "tensorflow":
        variants = args.variants or ("plain", "control", "kept", "floor")
        if backend == "jax":
            variants = [v for v in variants if v != "floor"]  # XLA's cost analysis instead
        passes = 1
    variants = ["plain", "control"] + [v for v in variants if v not in ("plain", "control")]
    default = ("mlp_1m", "embedding") if args.smoke else tuple(KEEPING_TARGETS)
    names = args.models or (default if backend == "tensorflow" else ("mlp_1m", "conv"))
    jits = {"off": [False], "on": [True], "both": [False, True]}[
        args.jit or ("off" if args.smoke or backend != "tensorflow" else "both")
    ]
    configs = []
    for name in names:
        spec = specs[name]
        if args.batch_size:
            spec = spec._replace(batch_size=args.batch_size)
        for jit in jits:
            weights = initial_weights(spec)
            keys = [(v, i) for i in range(args.instances) for v in variants]
            built = {k: keeping_model(k[0], spec, weights, jit, args.optimizer) for k in keys}
            if backend == "tensorflow":
                from models import batch_of

                runners = {k: tf_runner(m, c, batch_of(spec)) for k, (m, c) in built.items()}
            else:
                steps = 3 if args.smoke else args.steps
                runners = {k: fit_runner(m, spec, steps) for k, (m, _) in built.items()}
            # Warmed up only once all are built: building seeds, and seeding
            # clears TensorFlow's kernel caches.
            for run in runners.values():
                run(3 if backend == "tensorflow" else 2)
            if backend == "tensorflow":
                steps = calibrate(runners["plain", 0], pass_seconds)
            params = params_of(built["plain", 0][0])
            log(f"  {name} jit={jit}: {params:,} params, {steps} steps/pass")
            runs = [time_rounds(runners, args.rounds or rounds, passes, steps)]
            found = config(
                runs,
                "plain",
                name,
                spec,
                params,
                jit_compile=jit,
                instances=args.instances,
                steps=steps,
                pairs=[("kept", "floor")] if "floor" in variants else [],
                targets={"kept": KEEPING_TARGETS[name]} if name in KEEPING_TARGETS else None,
                tolerance=KEEPING_TOLERANCE,
            )
            if backend == "jax":
                found["xla"] = xla_cost({v: built[v, 0][0] for v in ("plain", "kept")}, spec)
            configs.append(found)
            del built, runners
            keras.backend.clear_session()
    out = {"configs": configs, "optimizer": args.optimizer}
    if args.ops and backend == "tensorflow":
        out["op_counts"] = [op_counts(name, specs[name], args.optimizer) for name in names]
    return out


def xla_cost(models, spec):
    """Bytes accessed and flops of one compiled step by XLA's cost analysis,
    and the kept step's extra bytes in parameter-sized float32 writes."""
    import jax
    from models import batch_of

    batch = tuple(jax.numpy.asarray(a) for a in batch_of(spec))
    found = {}
    for variant, model in models.items():
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        if variant == "plain":
            # As Keras 3.15's `JAXTrainer.make_train_function` jits it.
            lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, batch)
        else:
            keeper = model._keeper
            lowered = keeper.compiled_step(True).lower(state, keeper.slots, batch)
        cost = lowered.compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        found[variant] = {"bytes": float(cost["bytes accessed"]), "flops": float(cost["flops"])}
    params = params_of(models["plain"])
    found["extra_bytes_in_parameter_writes"] = (
        found["kept"]["bytes"] - found["plain"]["bytes"]
    ) / (4 * params)
    return found


def op_counts(name, spec, optimizer):
    """Ops in the traced `train_step` graph: plain, keeping off, keeping on."""
    import collections

    import keras
    import tensorflow as tf
    from models import batch_of
    from models import keeping_model

    x, y = batch_of(spec)
    data = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    counts = {}
    for variant in ("plain", "off", "kept"):
        model = keeping_model(variant, spec, initial_weights(spec), False, optimizer)[0]
        tf_runner(model, None, (x, y))
        graph = tf.function(model.train_step).get_concrete_function(data).graph
        counts[variant] = collections.Counter(op.type for op in graph.get_operations())
    keras.backend.clear_session()
    return {
        "model": name,
        **{v: sum(c.values()) for v, c in counts.items()},
        "off_equals_plain": counts["off"] == counts["plain"],
        "kept_extra_ops": dict(sorted((counts["kept"] - counts["plain"]).items())),
        "kept_missing_ops": dict(sorted((counts["plain"] - counts["kept"]).items())),
    }


def metrics(args, specs, mode, dynamics=False):
    """What gradient metrics add to a `KeepGradModel` step (1M MLP)."""
    import models
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    if dynamics and args.mirrored:
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    replicas = strategy.num_replicas_in_sync
    rounds, passes, pass_seconds = mode
    if dynamics:
        variants = models.DYNAMICS + (("floor_replicas",) if replicas > 1 else ())
        floors = models.MIRRORED_FLOORS if replicas > 1 else models.FLOORS
        pairs = list(floors.items())
        targets = dict.fromkeys(floors, DYNAMICS_TARGET)
    else:
        variants = args.variants or (models.METRICS[:3] if args.quick else models.METRICS)
        pairs, targets = [], {"grad_norm": METRICS_TARGET}
    spec = specs["mlp_1m"]
    weights = initial_weights(spec)
    built = {}
    for v in variants:
        with strategy.scope():
            model = models.compiled(
                spec,
                models.kg.KeepGradModel,
                weights,
                metrics=models.gradient_metrics(v),
                jit_compile=args.jit,
            )
        built[v, 0] = tf_runner(model, None, models.batch_of(spec))
    for run in built.values():
        run(3)
    steps = calibrate(built["reference", 0], pass_seconds)
    log(f"  {replicas} replica(s), jit={args.jit}: {steps} steps/round")
    runs = [time_rounds(built, args.rounds or rounds, passes, steps)]
    found = config(
        runs,
        "reference",
        "mlp_1m",
        spec,
        params_of(model),
        jit_compile=args.jit,
        replicas=replicas,
        steps=steps,
        pairs=pairs,
        targets=targets,
        tolerance=DYNAMICS_TOLERANCE if dynamics else None,
    )
    return {"configs": [found]}


def tensorboard(args, specs, mode):
    """What watching costs per `fit`, each `fit` with fresh callbacks."""
    import keras
    import models

    setup = models.SETUPS[args.setup]
    backend = keras.backend.backend()
    if args.setup != "watched" and backend != "tensorflow":
        raise SystemExit(f"--setup {args.setup} runs on TensorFlow only, not {backend}.")
    rounds = {"watched": 10, "batch": 5, "epoch": 15}[args.setup]
    steps, epochs = setup["steps"], setup["epochs"]
    if args.smoke:
        rounds, steps = 2, 3
    elif args.quick:
        rounds, steps = 5, max(1, steps // 5)
    steps = args.steps or steps
    base = setup["variants"][0]
    configs = []
    with tempfile.TemporaryDirectory(prefix="bench_tb_") as root:
        for name in args.models or setup["models"]:
            spec = specs[name]
            weights = initial_weights(spec)
            runners = {
                (v, 0): watch_runner(args.setup, v, spec, weights, root, steps, epochs)
                for v in setup["variants"]
            }
            for variant, run in runners.items():
                run(0, check=True)  # warm-up: tracing, first writers
            runs = [time_rounds(runners, args.rounds or rounds, 1, steps)]
            pairs = [("grad_tb", "keras_tb"), ("grad_tb_1", "keras_tb_1"), ("monitor", "none")]
            configs.append(
                config(
                    runs,
                    base,
                    name,
                    spec,
                    runners[base, 0].params,
                    setup=args.setup,
                    steps=steps * epochs,
                    steps_per_epoch=steps,
                    pairs=pairs if args.setup == "epoch" else [],
                    targets={"all": WATCH_TARGETS[name]} if name in WATCH_TARGETS else None,
                    measures=("wall", "cpu", "hooks_seconds", "event_bytes"),
                )
            )
    return {"configs": configs}


def watch_runner(setup, variant, spec, weights, root, steps, epochs):
    """`run(_, check=False)`: one `fit` of `variant` with fresh callbacks and
    log directory; per step: wall and CPU seconds from `on_train_begin` to
    `on_train_end`, seconds in the callbacks' hooks, event-file bytes."""
    import keras
    import models

    cls, metrics, _ = models.watch_variant(setup, variant, root)
    model = models.compiled(spec, cls, weights, metrics=metrics)
    x, y = models.batch_of(spec)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        data = dict(x=tf.data.Dataset.from_tensors((x, y)).repeat(), steps_per_epoch=steps)
    else:
        data = dict(x=x.repeat(steps, 0), y=y.repeat(steps, 0), batch_size=spec.batch_size)
    count = [0]

    def run(_, check=False):
        count[0] += 1
        log_dir = os.path.join(root, variant, str(count[0]))
        callbacks = models.watch_variant(setup, variant, log_dir)[2]
        state = {"hooks": 0.0}
        for callback in callbacks:
            _instrument(callback, state)
        callbacks = [_clock(state, "begin"), *callbacks, _clock(state, "end")]
        model.fit(**data, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
        written = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(log_dir) for f in fs
        )
        if check and any(isinstance(c, models.kg.callbacks.GradientTensorBoard) for c in callbacks):
            _check_written(log_dir)
        shutil.rmtree(log_dir, ignore_errors=True)
        n = steps * epochs
        wall, cpu = (end - begin for begin, end in zip(state["begin"], state["end"]))
        return [wall / n, cpu / n, state["hooks"] / n, written / n]

    run.params = params_of(model)
    return run


def _clock(state, key):
    """Put first (`begin`) and last (`end`) among the callbacks: the wall
    and CPU time between hold every batch and every callback's work, not
    `fit`'s own set-up and tear-down (releasing a `tf.data` iterator varies
    by a second on a shared machine)."""
    import keras

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if key == "begin":
                state[key] = (time.perf_counter(), time.process_time())

        def on_train_end(self, logs=None):
            if key == "end":
                state[key] = (time.perf_counter(), time.process_time())

    return Clock()


def _instrument(callback, state):
    """Adds the wall time spent in `callback`'s hooks to `state["hooks"]`.
    (Keras decides on asynchronous batch hooks by whether
    `on_train_batch_end` is overridden, as it is in every callback here.)"""
    for name in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end"):
        _time_hook(callback, name, state)
    _time_hook(callback, "on_train_batch_begin", state)
    _time_hook(callback, "on_train_batch_end", state)


def _time_hook(callback, name, state):
    method = getattr(callback, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            state["hooks"] += time.perf_counter() - start

    setattr(callback, name, timed)


def _check_written(log_dir):
    """The gradient TensorBoard wrote its norms: no silent no-op is timed."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(os.path.join(log_dir, "train"))
    acc.Reload()
    if "gradients/global_norm" not in acc.Tags()["tensors"]:
        raise RuntimeError(f"GradientTensorBoard wrote no gradient norms in {log_dir}")


# glibc keeps freed memory below a threshold that grows with the sizes it
# sees (up to 32 MB): a tensor freed may stay resident, and the peak RSS then
# measures the allocator's history as much as the live buffers. With a fixed
# low threshold every large tensor is its own mapping, returned on free.
# "mmap-no-onednn" also turns off TensorFlow's oneDNN ops and their buffers.
ALLOCATORS = {
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "default": {},
    "mmap-no-onednn": {"MALLOC_MMAP_THRESHOLD_": "65536", "TF_ENABLE_ONEDNN_OPTS": "0"},
}


def memory(args, specs, mode):
    """Peak RSS of each variant trained in fresh processes, one at a time
    (how a step's ops overlap, and so its peak, changes under contention)."""
    import numpy as np

    full = not (args.smoke or args.quick)
    names = args.models or (("mlp_10m", "embedding") if full else ("mlp_10m",))
    names = ("mlp_1m",) if args.smoke and not args.models else names
    allocators = args.allocators or (tuple(ALLOCATORS) if full else ("mmap",))
    variants = args.variants or (("plain", "kept", "hand") if full else ("plain", "kept"))
    pairs = args.rounds or (3 if full else 1)
    found = []
    for allocator in allocators:
        for name in names:
            records = {v: [] for v in variants}
            for i in range(pairs):
                for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
                    cmd = [sys.executable, __file__, "memory", "--child", name, v]
                    cmd += ["--optimizer", args.optimizer] + (["--smoke"] if args.smoke else [])
                    child = subprocess.run(
                        cmd,
                        capture_output=True,
                        text=True,
                        env=dict(os.environ, **ALLOCATORS[allocator]),
                    )
                    if child.returncode:
                        raise RuntimeError(f"memory of {name}/{v} failed:\n{child.stderr}")
                    records[v].append(json.loads(child.stdout.strip().splitlines()[-1]))
            mb = 2**20
            entry = {"model": name, "allocator": allocator, "params": records["plain"][0]["params"]}
            entry["param_mb"] = entry["params"] * 4 / mb
            for key in ("peak_rss", "training_growth"):
                values = {v: [r[key] and r[key] / mb for r in rs] for v, rs in records.items()}
                entry[key + "_mb"] = values
                for v in variants[1:]:
                    ok = None not in values[v] + values["plain"]
                    entry[f"{v}_extra_{key}_mb"] = (
                        float(np.median(values[v]) - np.median(values["plain"])) if ok else None
                    )
            log(f"  memory {name} ({allocator}): kept over plain {entry['kept_extra_peak_rss_mb']}")
            found.append(entry)
    return {"memory": found}


def memory_child(name, variant, specs, optimizer):
    """In a fresh process: train one variant; print its RSS figures as JSON.

    `peak_rss`: the process's peak. `training_growth`: the peak during
    training over the RSS just before (model built and compiled), which
    leaves out the import and build peaks.
    """
    from models import batch_of
    from models import keeping_model

    spec = specs[name]
    model, callback = keeping_model(variant, spec, initial_weights(spec), False, optimizer)
    gc.collect()
    peak_before, rss_before = _status("VmHWM"), _status("VmRSS")
    try:  # restart the peak from the current RSS (Linux 4.0+)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    tf_runner(model, callback, batch_of(spec))(20)
    peak = _status("VmHWM")
    growth = peak - rss_before if reset and rss_before else None
    print(
        json.dumps(
            {
                "peak_rss": max(peak, peak_before),
                "training_growth": growth,
                "params": params_of(model),
            }
        )
    )


def _status(field):
    """`VmHWM` (peak RSS) or `VmRSS` of this process, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field == "VmHWM":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None


SUBCOMMANDS = {"keeping": keeping, "metrics": metrics, "tensorboard": tensorboard, "memory": memory}


def dynamics(args, specs, mode):
    """What the noise scale, SNR and cosine add, beside their floors."""
    return metrics(args, specs, mode, dynamics=True)


SUBCOMMANDS["dynamics"] = dynamics


# --- processes, backends and pooling --------------------------------------


def child_argv(argv, **options):
    """`argv` without `--processes`, `--backend` and `--out`, with
    `options` instead."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--processes", "--backend", "--out"):
            skip = True
        elif not arg.startswith(("--processes=", "--backend=", "--out=")):
            out.append(arg)
    for key, value in options.items():
        out += [f"--{key}", str(value)]
    return out


def in_children(argv, options_list, backend):
    """Runs `run.py` once per `options`, one after another, on `backend`
    unless an `options` names one; their results."""
    with tempfile.TemporaryDirectory() as tmp:
        for k, options in enumerate(options_list):
            path = os.path.join(tmp, f"{k}.json")
            log(f"process {k + 1} of {len(options_list)}: {options}")
            env = dict(os.environ, KERAS_BACKEND=options.get("backend", backend))
            subprocess.run(
                [sys.executable, __file__, *child_argv(argv, out=path, **options)],
                check=True,
                stdout=subprocess.DEVNULL,  # the parent prints the pooled tables
                env=env,
            )
            with open(path) as f:
                yield json.load(f)


def _key(c):
    return tuple(str(c.get(k)) for k in ("model", "jit_compile", "batch_size", "setup", "replicas"))


def pool(results):
    """One result from several runs of one subcommand and backend: the
    configs all of them timed, their processes' rounds pooled.

    Raises:
        ValueError: the runs differ in subcommand, backend or variants, or
            share no config.
    """
    import stats

    for key in ("command", "backend", "optimizer"):
        if len({str(r.get(key)) for r in results}) > 1:
            raise ValueError(f"The runs to pool must share their `{key}`.")
    common = [
        _key(c)
        for c in results[0]["configs"]
        if all(_key(c) in map(_key, r["configs"]) for r in results[1:])
    ]
    if not common:
        raise ValueError("The runs to pool share no config (model, jit, batch size, setup).")
    pooled = dict(results[0], configs=[], complete=True)
    for key in common:
        found = [next(c for c in r["configs"] if _key(c) == key) for r in results]
        if len({tuple(c["runs"][0]) for c in found}) > 1:
            raise ValueError(f"The runs to pool time different variants of {key[0]}.")
        first = dict(found[0], runs=[run for c in found for run in c["runs"]])
        args = {k: first[k] for k in ("pairs", "targets", "tolerance", "measures") if k in first}
        args["pairs"] = [tuple(p) for p in args.get("pairs", [])]
        first.update(stats.summarize(first["runs"], first["base"], **args))
        pooled["configs"].append(first)
    pooled["memory"] = [m for r in results for m in r.get("memory", [])]
    return pooled


# --- tables ---------------------------------------------------------------


def _pct(x):
    return f"{x * 100:+.1f}%"


def _cell(d):
    found = f"{_pct(d['median'])} [{_pct(d['ci90'][0])}, {_pct(d['ci90'][1])}]"
    if "process_medians" in d:
        p = d["process_medians"]
        lo, hi = p["interval"]["low"], p["interval"]["high"]
        found += f"; processes {_pct(p['median'])} [{_pct(lo)}, {_pct(hi)}]"
    return found


def markdown(result):
    if "backends" in result:
        return "\n\n".join(f"## {b}\n\n{markdown(r)}" for b, r in result["backends"].items())
    lines = []
    for c in result.get("configs", []):
        jit = "" if c.get("jit_compile") is None else f", jit {c['jit_compile']}"
        lines += [
            f"### {c['model']}: {c['params']:,} parameters, batch {c['batch_size']}{jit}, "
            f"{c['processes']} process(es), {c['rounds']} rounds; base `{c['base']}`",
            "",
            "| variant | ms/step | ratio, wall [IQR] | ratio, CPU [IQR] | fastest rounds | "
            "beyond control, wall [90%] | beyond control, CPU [90%] | hooks ms/step | "
            "event bytes/step |",
            "|---|---:|---|---|---:|---|---|---:|---:|",
        ]
        for v, ms in c["step_ms"].items():
            r, q = c["wall"]["ratio"][v], c["cpu"]["ratio"][v]
            hooks = c.get("hooks_seconds_per_step", {}).get(v)
            written = c.get("event_bytes_per_step", {}).get(v)
            lines.append(
                f"| {v} | {ms:.2f} | {r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}] | "
                f"{q['median']:.3f} [{q['q25']:.3f}, {q['q75']:.3f}] | "
                f"{c['wall']['fastest_ratio'][v]:.3f} | {_cell(c['wall']['beyond_control'][v])} | "
                f"{_cell(c['cpu']['beyond_control'][v])} | "
                f"{'' if hooks is None else f'{hooks * 1e3:.3f}'} | "
                f"{'' if written is None else f'{written:.0f}'} |"
            )
        for pair, d in c["wall"]["pairs"].items():
            cpu = c["cpu"]["pairs"][pair]
            lines.append(
                f"\n`{pair}` per round over the base: wall {_cell(d)}, CPU {_cell(cpu)}; "
                f"ratio, CPU {cpu['ratio']['median']:.3f} "
                f"[{cpu['ratio']['q25']:.3f}, {cpu['ratio']['q75']:.3f}]"
            )
        for subject, v in c["verdicts"].items():
            line = f"\n{subject}: at most {_pct(v['target'])} beyond control: {v['budget']}"
            if "floor" in v:
                line += (
                    f"; against {v['floor']} (within {_pct(v['tolerance'])} of it, "
                    f"within noise): {v['against_floor']}"
                )
            lines.append(line)
        if "xla" in c:
            lines.append(
                f"\nXLA: flops plain {c['xla']['plain']['flops']:.0f}, kept "
                f"{c['xla']['kept']['flops']:.0f}; kept's extra bytes accessed, in "
                f"parameter writes: {c['xla']['extra_bytes_in_parameter_writes']:.2f}"
            )
        lines.append("")
    for o in result.get("op_counts", []):
        extra = ", ".join(f"{k} x{n}" for k, n in o["kept_extra_ops"].items())
        lines.append(
            f"- ops of `train_step`, {o['model']}: plain {o['plain']}, keeping off "
            f"{o['off']}, kept {o['kept']}; kept adds {extra}"
        )
    for m in result.get("memory", []):
        extras = ", ".join(
            f"{k[: -len('_extra_peak_rss_mb')]} {v:+.1f} MB"
            for k, v in m.items()
            if k.endswith("_extra_peak_rss_mb") and v is not None
        )
        lines.append(
            f"- peak RSS over plain, {m['model']} ({m['param_mb']:.1f} MB of parameters, "
            f"{m['allocator']} malloc): {extras}"
        )
    return "\n".join(lines)


# --- command line ---------------------------------------------------------


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more. Received: {value}")
    return value


def make_parser():
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    mode = common.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny models, 2 rounds")
    mode.add_argument("--quick", action="store_true", help="a few minutes")
    common.add_argument("--rounds", type=_positive_int, help="override the mode's rounds")
    common.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        help="time in this many fresh processes and pool their rounds",
    )
    common.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: its default)",
    )
    common.add_argument("--models", nargs="+", help="only these models")
    common.add_argument("--variants", nargs="+", help="only these variants (base, control kept)")
    common.add_argument("--out", help="JSON path; default benchmarks/results/")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = {
        name: sub.add_parser(
            name, parents=[common], allow_abbrev=False, help=fn.__doc__.split("\n")[0]
        )
        for name, fn in SUBCOMMANDS.items()
    }
    for name in ("keeping", "tensorboard"):
        p[name].add_argument(
            "--backend",
            choices=(*BACKENDS, "all"),
            help="Keras backend (default: KERAS_BACKEND or tensorflow); "
            "all: each in a fresh process",
        )
        p[name].add_argument(
            "--steps", type=int, default=0, help="steps per pass (default: by time, or the setup's)"
        )
    for name in ("keeping", "memory"):
        p[name].add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    k = p["keeping"]
    k.add_argument("--jit", choices=("off", "on", "both"), help="default both (smoke: off)")
    k.add_argument(
        "--instances",
        type=_positive_int,
        default=1,
        help="model objects per variant, timed in turn and averaged",
    )
    k.add_argument("--pass-seconds", type=float, help="base training time per pass")
    k.add_argument("--passes", type=_positive_int, help="passes per round")
    k.add_argument("--batch-size", type=_positive_int, help="override the models' batch size")
    k.add_argument("--ops", action="store_true", help="also count the traced step's ops")
    for name in ("metrics", "dynamics"):
        p[name].add_argument("--jit", action="store_true", help="jit_compile=True")
    p["dynamics"].add_argument(
        "--mirrored", action="store_true", help="MirroredStrategy on 2 logical CPUs"
    )
    p["tensorboard"].add_argument(
        "--setup", choices=("watched", "batch", "epoch"), default="watched"
    )
    p["memory"].add_argument("--allocators", nargs="+", choices=tuple(ALLOCATORS))
    p["memory"].add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    pool_parser = sub.add_parser("pool", help="time nothing: pool the JSON of earlier runs")
    pool_parser.add_argument("files", nargs="+")
    pool_parser.add_argument("--out")
    return parser


def _versions():
    import importlib

    import keras

    found = {"python": platform.python_version(), "keras": keras.__version__}
    backend = keras.backend.backend()
    found[backend] = importlib.import_module(backend).__version__
    return found


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser().parse_args(argv)
    started = time.perf_counter()
    if args.command == "pool":
        results = []
        for path in args.files:
            with open(path) as f:
                results.append(json.load(f))
            if "configs" not in results[-1]:
                raise SystemExit(f"{path} is not the JSON of a `run.py` subcommand.")
        result = pool(results)
        mode = "pooled"
    else:
        mode = "smoke" if args.smoke else "quick" if args.quick else "full"
        backend = getattr(args, "backend", None) or os.environ.get("KERAS_BACKEND", "tensorflow")
        if backend == "all":
            runs = in_children(argv, [{"backend": b} for b in BACKENDS], backend)
            result = {"command": args.command, "backends": dict(zip(BACKENDS, runs))}
        elif args.processes > 1:
            runs = list(in_children(argv, [{"processes": 1}] * args.processes, backend))
            result = pool(runs)
        else:
            result = measure(args, backend, mode)
        result.update(mode=mode, argv=argv)
    out = args.out or os.path.join(HERE, "results", f"{args.command}-{mode}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if not getattr(args, "child", None):
        print(markdown(result))
        log(f"wrote {out} in {time.perf_counter() - started:.0f}s")
    return result


def measure(args, backend, mode):
    os.environ["KERAS_BACKEND"] = backend
    if getattr(args, "mirrored", False):
        import tensorflow as tf

        # Before TensorFlow runs any op, which fixes its devices.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"Keras already runs on {keras.backend.backend()}, not {backend}.")
    import tensorflow as tf

    # One trace per model and iterator type is expected; TensorFlow's
    # "excessive retracing" warning counts them across models.
    tf.get_logger().setLevel("ERROR")
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import models

    specs = models.SMOKE_MODELS if args.smoke else models.MODELS
    if args.command == "memory" and args.child:
        memory_child(*args.child, specs, args.optimizer)
        sys.exit(0)
    rounds, passes, seconds = MODES.get(args.command, {}).get(mode, (0, 1, 0.0))
    if args.command == "keeping":
        passes = args.passes or passes
        seconds = seconds if args.pass_seconds is None else args.pass_seconds
    if args.command == "keeping" and backend != "tensorflow" and not args.steps:
        args.steps = 40
    result = {
        "command": args.command,
        "backend": backend,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg": list(os.getloadavg()),
        },
        "versions": _versions(),
        "threads": args.threads or "default",
    }
    result.update(SUBCOMMANDS[args.command](args, specs, (rounds, passes, seconds)))
    return result


if __name__ == "__main__":
    main()
