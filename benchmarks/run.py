"""What keeping gradients, gradient metrics and callbacks cost, against plain Keras.

Every subcommand times its variants in paired, interleaved rounds in one
process: each round runs every variant for the same number of steps, in an
order rotated each round, and divides each variant's time by the same
round's time of the base (a plain `keras.Model`, or for the metrics a
`KeepGradModel` without them); a second base model is the noise control.
`benchmarks/README.md` describes the method, the variants and the results.

    python benchmarks/run.py keeping --quick   # also: memory, metrics, dynamics, tensorboard
    python benchmarks/run.py keeping --smoke   # tiny models, 2 rounds: checks it runs
    python benchmarks/run.py tensorboard --backend all   # each backend in a fresh process
    python benchmarks/run.py pool a.json b.json          # pool runs made apart

Results are printed as Markdown and written as JSON to
`benchmarks/results/<subcommand>-<mode>.json` (or `--out`). Do not edit
`keras_keepgrad/` during a run: autograph reads a function's source file
when it first traces it.
"""

import argparse
import collections
import contextlib
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
for _path in (os.path.dirname(HERE), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)
BACKENDS = ("tensorflow", "jax", "torch")


def _option_in(argv, option):
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _backend_in(argv):
    return _option_in(argv, "--backend")


# Keras reads its backend when first imported.
if __name__ == "__main__" and _backend_in(sys.argv) in BACKENDS:
    os.environ["KERAS_BACKEND"] = _backend_in(sys.argv)
# XLA reads its flags when JAX makes its CPU client: one thread for
# `--threads 1` (XLA's CPU client takes no other count).
if (
    __name__ == "__main__"
    and os.environ.get("KERAS_BACKEND") == "jax"
    and _option_in(sys.argv, "--threads") == "1"
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import models  # noqa: E402
import numpy as np  # noqa: E402
import stats  # noqa: E402
import tensorflow as tf  # noqa: E402

# The most overhead beyond the control each may cost.
KEEPING_TARGETS = {"mlp_1m": 0.02, "conv": 0.02, "mlp_10m": 0.03, "embedding": 0.03}
METRICS_TARGET, DYNAMICS_TARGET = 0.02, 0.03
WATCH_TARGETS = {"mlp_6k": 0.30, "mlp_1m": 0.10, "tiny": 0.30, "mlp_1m_wide": 0.10}
# A target below what the hardware allows is judged against the floor
# measured in the same run: met within noise of it (keeping), or within
# about 3 points of it (each dynamics statistic).
KEEPING_TOLERANCE, DYNAMICS_TOLERANCE = 0.0, 0.03
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
    """`{variant: [rounds][measures]}` of `runners` in paired rounds.

    `runners[variant, instance](steps)` runs `steps` steps and returns its
    measures per step. A round's value of an instance is its fastest pass
    (other processes only ever add time); a variant's is the mean over its
    instances, which averages out what makes one model object persistently
    faster or slower than an identical one.
    """
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


def _clocks():
    return time.perf_counter(), time.process_time()


def _per_step(start, steps):
    return [(now - then) / steps for now, then in zip(_clocks(), start)]


def tf_runner(model, callback, spec):
    """Steps through `model.train_function` on an iterator over one batch,
    the callback called as `fit` would."""
    batch = tuple(tf.constant(a) for a in models.batch_of(spec))
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    callbacks = [callback] if callback else None
    model.fit(dataset, steps_per_epoch=2, shuffle=False, verbose=0, callbacks=callbacks)
    # The iterator type `fit` uses, so `train_function` is not retraced.
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))

    def run(steps):
        train_function, start = model.train_function, _clocks()
        for step in range(steps):
            logs = train_function(iterator)
            if callback is not None:
                callback.on_train_batch_end(step, logs)
        float(logs["loss"])  # the step's outputs exist: it has finished
        return _per_step(start, steps)

    return run


def fit_runner(model, spec, steps):
    """Steps through `model.fit` on `steps` batches (JAX and PyTorch)."""
    x, y = models.batch_of(spec, spec.batch_size * steps)

    def run(n):
        start, end = _clocks(), n * spec.batch_size
        model.fit(x[:end], y[:end], batch_size=spec.batch_size, shuffle=False, verbose=0)
        if keras.backend.backend() == "jax":
            import jax

            # Dispatch is asynchronous on JAX; PyTorch's CPU ops are not.
            jax.block_until_ready([v.value for v in model.trainable_variables])
        return _per_step(start, n)

    return run


def calibrate(run, pass_seconds):
    """Steps per pass: about `pass_seconds` of the base's training."""
    return max(1, int(round(pass_seconds / min(run(3)[0] for _ in range(2)))))


def initial_weights(spec):
    keras.utils.set_random_seed(0)
    return keras.Model(*spec.build()).get_weights()


def params_of(model):
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def config(runs, name, spec, model, base, summary, **extra):
    """A config's JSON: what was timed, its raw rounds and their summary."""
    found = dict(model=name, params=params_of(model), batch_size=spec.batch_size, base=base)
    found.update(extra, **summary, runs=runs)
    found.update(stats.summarize(runs, base, **summary))
    return found


# --- subcommands --------------------------------------------------------


def keeping(args, specs, mode):
    """`KeepGradModel` against `keras.Model`, and against what else keeps."""
    backend = keras.backend.backend()
    rounds, passes, pass_seconds = mode
    variants = args.variants or (
        models.KEEPING[:3] + ("recompute",) if args.quick else models.KEEPING
    )
    names = args.models or (("mlp_1m", "embedding") if args.smoke else tuple(KEEPING_TARGETS))
    if backend != "tensorflow":
        # Keras's own step; on JAX, XLA's cost analysis instead of a floor.
        variants = args.variants or ("plain", "control", "kept") + ("floor",) * (backend == "torch")
        names, passes = args.models or ("mlp_1m", "conv"), 1
    variants = ["plain", "control"] + [v for v in variants if v not in ("plain", "control")]
    # Keras's default elsewhere: jitted on JAX, eager on PyTorch.
    jit = args.jit or ("auto" if backend != "tensorflow" else "off" if args.smoke else "both")
    strategy = _strategy(args, backend)
    if strategy.num_replicas_in_sync > 1:
        jit = "off"  # plain Keras's step fails under XLA there
    configs = []
    for name in names:
        spec = specs[name]._replace(batch_size=args.batch_size or specs[name].batch_size)
        for jit_compile in {"off": [False], "on": [True], "both": [False, True]}.get(jit, [jit]):
            weights = initial_weights(spec)
            keys = [(v, i) for i in range(args.instances) for v in variants]
            with strategy.scope():
                built = {
                    k: models.keeping_model(k[0], spec, weights, jit_compile, args.optimizer)
                    for k in keys
                }
            if backend == "tensorflow":
                runners = {k: tf_runner(m, c, spec) for k, (m, c) in built.items()}
            else:
                steps = 3 if args.smoke else args.steps or 40
                runners = {k: fit_runner(m, spec, steps) for k, (m, _) in built.items()}
            # Warmed up only once all are built: building seeds, and seeding
            # clears TensorFlow's kernel caches.
            for run in runners.values():
                run(2)
            if backend == "tensorflow":
                steps = args.steps or calibrate(runners["plain", 0], pass_seconds)
            log(f"  {name} jit={jit_compile}: {steps} steps/pass")
            runs = [time_rounds(runners, args.rounds or rounds, passes, steps)]
            skipping = list(skipping_floors(variants).items())
            summary = dict(
                pairs=[("kept", "floor")] * ("floor" in variants) + skipping,
                targets=(
                    dict.fromkeys(["kept", *dict(skipping)], KEEPING_TARGETS[name])
                    if name in KEEPING_TARGETS
                    else None
                ),
                tolerance=KEEPING_TOLERANCE,
            )
            found = config(
                runs,
                name,
                spec,
                built["plain", 0][0],
                "plain",
                summary,
                jit_compile=jit_compile,
                instances=args.instances,
                replicas=strategy.num_replicas_in_sync,
                steps=steps,
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


def xla_cost(compiled, spec):
    """Bytes accessed and flops of one compiled step by XLA's cost analysis,
    and the kept step's extra bytes in parameter-sized float32 writes."""
    import jax

    batch = tuple(jax.numpy.asarray(a) for a in models.batch_of(spec))
    found = {}
    for variant, model in compiled.items():
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
    extra = found["kept"]["bytes"] - found["plain"]["bytes"]
    found["extra_bytes_in_parameter_writes"] = extra / (4 * params_of(compiled["plain"]))
    return found


def skipping_floors(variants):
    """`{skipping variant: its floor}` for those of `models.SKIPPING` in
    `variants`: the least an exact skip can cost that ran
    (`models.SKIPPING_FLOORS`), for spikes that floor with the spike rule
    bare (`models.SPIKE_FLOORS`) where it ran. Met within noise."""
    floor = next(f for f in models.SKIPPING_FLOORS if f in variants or f == "kept")
    spike_floor = models.SPIKE_FLOORS.get(floor)
    floors = dict(skip=floor, skip_spike=spike_floor if spike_floor in variants else floor)
    return {v: floors[v] for v in models.SKIPPING if v in variants}


def op_counts(name, spec, optimizer):
    """Ops in the traced `train_step` graph: plain, keeping off, keeping on."""
    x, y = models.batch_of(spec)
    data = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    counts = {}
    for variant in ("plain", "off", "kept"):
        model = models.keeping_model(variant, spec, initial_weights(spec), False, optimizer)[0]
        tf_runner(model, None, spec)
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


def _strategy(args, backend):
    """`MirroredStrategy` on 2 logical CPUs with `--mirrored`, else the default."""
    if not getattr(args, "mirrored", False):
        return tf.distribute.get_strategy()
    if backend != "tensorflow":
        raise SystemExit(f"--mirrored runs on TensorFlow only, not on {backend}.")
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def metrics(args, specs, mode, dynamics=False):
    """What gradient metrics add to a `KeepGradModel` step (1M MLP)."""
    backend = keras.backend.backend()
    strategy = _strategy(args, backend)
    replicas = strategy.num_replicas_in_sync
    if dynamics:
        variants = models.DYNAMICS + (("floor_replicas",) if replicas > 1 else ())
        floors = models.MIRRORED_FLOORS if replicas > 1 else models.FLOORS
        summary = dict(
            pairs=list(floors.items()),
            tolerance=DYNAMICS_TOLERANCE,
            targets=dict.fromkeys(floors, DYNAMICS_TARGET),
        )
    else:
        variants = args.variants or models.METRICS[: 3 if args.quick else None]
        variants = ["reference", "control"] + [v for v in variants if v not in models.METRICS[:2]]
        summary = dict(targets={"grad_norm": METRICS_TARGET})
    # Keras's default off TensorFlow: jitted on JAX, eager on PyTorch.
    jit = args.jit or ("auto" if backend != "tensorflow" else False)
    spec, runners = specs["mlp_1m"], {}
    weights = initial_weights(spec)
    # Off TensorFlow, whole `fit` calls (as `keeping` times them there), of
    # a multiple of the statistics' 4-step window.
    fixed = getattr(args, "steps", 0)
    steps = fixed or (4 if args.smoke else 40)
    for v in variants:
        with strategy.scope() if backend == "tensorflow" else contextlib.nullcontext():
            model = models.compiled(
                spec,
                models.kg.KeepGradModel,
                weights,
                metrics=models.gradient_metrics(v),
                jit_compile=jit,
            )
        if backend == "tensorflow":
            runners[v, 0] = tf_runner(model, None, spec)
        else:
            runners[v, 0] = fit_runner(model, spec, steps)
    for run in runners.values():
        run(3 if backend == "tensorflow" else steps)
    rounds, passes, pass_seconds = mode
    if backend == "tensorflow":
        steps = fixed or calibrate(runners["reference", 0], pass_seconds)
    log(f"  {replicas} replica(s), jit={jit}: {steps} steps/round")
    runs = [time_rounds(runners, args.rounds or rounds, passes, steps)]
    found = config(
        runs,
        "mlp_1m",
        spec,
        model,
        "reference",
        summary,
        jit_compile=jit,
        replicas=replicas,
        steps=steps,
    )
    return {"configs": [found]}


def dynamics(args, specs, mode):
    """What the noise scale, SNR and cosine add, beside their floors."""
    return metrics(args, specs, mode, dynamics=True)


def tensorboard(args, specs, mode):
    """What watching costs per `fit`, each `fit` with fresh callbacks."""
    setup, backend = models.SETUPS[args.setup], keras.backend.backend()
    if args.setup != "watched" and backend != "tensorflow":
        raise SystemExit(f"--setup {args.setup} runs on TensorFlow only, not on {backend}.")
    rounds, steps = setup["rounds"], setup["steps"]
    if args.smoke or args.quick:
        rounds, steps = (2, 3) if args.smoke else (5, max(1, steps // 5))
    steps, epochs, base = args.steps or steps, setup["epochs"], setup["variants"][0]
    pairs = [("grad_tb", "keras_tb"), ("grad_tb_1", "keras_tb_1"), ("monitor", "none")]
    configs = []
    with tempfile.TemporaryDirectory(prefix="bench_tb_") as root:
        for name in args.models or setup["models"]:
            spec = specs[name]
            weights = initial_weights(spec)
            runners = {
                (v, 0): watch_runner(args.setup, v, spec, weights, root, steps, epochs)
                for v in setup["variants"]
            }
            for run in runners.values():
                run(0, check=True)  # warm-up: tracing, first writers
            runs = [time_rounds(runners, args.rounds or rounds, 1, steps)]
            # Event bytes per step once a run is long: those of a fit ten
            # times as long, less this one's, over the extra steps (what is
            # written once per fit or epoch, the heatmap's image and the
            # layouts, cancels out).
            steady = {
                v: (run(0, fit_steps=10 * steps)[4] * 10 - run(0)[4]) / 9
                for (v, _), run in runners.items()
                if args.setup == "watched"
            }
            summary = dict(
                pairs=pairs if args.setup == "epoch" else [],
                targets=(
                    {"watched" if args.setup == "watched" else "all": WATCH_TARGETS[name]}
                    if name in WATCH_TARGETS and args.setup != "epoch"
                    else None
                ),
                measures=(
                    "wall",
                    "cpu",
                    "batch_wall",
                    "hooks_seconds",
                    "event_bytes",
                    "heatmap_seconds",
                ),
            )
            configs.append(
                config(
                    runs,
                    name,
                    spec,
                    runners[base, 0].model,
                    base,
                    summary,
                    setup=args.setup,
                    steps=steps * epochs,
                    steps_per_epoch=steps,
                    steady_event_bytes_per_step=steady,
                )
            )
    return {"configs": configs}


def watch_runner(setup, variant, spec, weights, root, steps, epochs):
    """`run(_, check=False)`: one `fit` of `variant` with fresh callbacks and
    log directory; per step: wall and CPU seconds from `on_train_begin` to
    `on_train_end`, seconds in the callbacks' hooks, event-file bytes."""
    cls, gradient_metrics, _ = models.watch_variant(setup, variant, root)
    model = models.compiled(spec, cls, weights, metrics=gradient_metrics)
    x, y = models.batch_of(spec)

    def data_of(steps):
        if keras.backend.backend() == "tensorflow":
            return dict(x=tf.data.Dataset.from_tensors((x, y)).repeat(), steps_per_epoch=steps)
        return dict(x=x.repeat(steps, 0), y=y.repeat(steps, 0), batch_size=spec.batch_size)

    fits = iter(range(1 << 30))

    def run(_, check=False, fit_steps=steps):
        data = data_of(fit_steps)
        log_dir = os.path.join(root, variant, str(next(fits)))
        callbacks = models.watch_variant(setup, variant, log_dir)[2]
        state = {"hooks": 0.0}
        for callback in callbacks:
            for hook in (
                "on_train_begin",
                "on_train_end",
                "on_epoch_begin",
                "on_epoch_end",
                "on_train_batch_begin",
                "on_train_batch_end",
            ):
                _time_hook(callback, hook, state)
        callbacks = [_Clock(state, "begin"), *callbacks, _Clock(state, "end")]
        model.fit(**data, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
        written = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(log_dir) for f in fs
        )
        if check and any(isinstance(c, models.kg.callbacks.GradientTensorBoard) for c in callbacks):
            _check_written(log_dir)
        shutil.rmtree(log_dir, ignore_errors=True)
        n = fit_steps * epochs
        wall, cpu = (end - begin for begin, end in zip(state["begin"], state["end"]))
        # The heatmap figure is drawn once per epoch at most: a cost per
        # epoch, not per batch, shown apart (it is in `wall` and `hooks`;
        # `batch_wall` is `wall` without it).
        heatmap = sum(getattr(c, "_heatmap_seconds", 0.0) for c in callbacks)
        return [
            wall / n,
            cpu / n,
            (wall - heatmap) / n,
            state["hooks"] / n,
            written / n,
            heatmap / n,
        ]

    run.model = model
    return run


class _Clock(keras.callbacks.Callback):
    """Put first (`begin`) and last (`end`) among the callbacks: the time
    between holds every batch and every callback's work, not `fit`'s own
    set-up and tear-down (releasing a `tf.data` iterator varies by a second
    on a shared machine)."""

    def __init__(self, state, key):
        super().__init__()
        self.state, self.key = state, key

    def on_train_begin(self, logs=None):
        if self.key == "begin":
            self.state["begin"] = _clocks()

    def on_train_end(self, logs=None):
        if self.key == "end":
            self.state["end"] = _clocks()


def _time_hook(callback, name, state):
    """Adds the wall time spent in `callback.<name>` to `state["hooks"]`.
    (Keras decides on asynchronous batch hooks by whether
    `on_train_batch_end` is overridden, as it is in every callback here.)"""
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
    if "gradients/log10_global_norm" not in acc.Tags()["tensors"]:
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
    full = not (args.smoke or args.quick)
    names = args.models or (("mlp_10m", "embedding")[: 2 if full else 1])
    names = ("mlp_1m",) if args.smoke and not args.models else names
    variants = args.variants or ("kept", "hand")[: 2 if full else 1]
    variants = ["plain"] + [v for v in variants if v != "plain"]
    found = []
    for allocator in args.allocators or (tuple(ALLOCATORS) if full else ("mmap",)):
        for name in names:
            peaks = {v: [] for v in variants}
            for i in range(args.rounds or (3 if full else 1)):
                for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
                    cmd = [sys.executable, __file__, "memory", "--child", name, v]
                    cmd += ["--optimizer", args.optimizer] + ["--smoke"] * args.smoke
                    env = dict(os.environ, **ALLOCATORS[allocator])
                    child = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if child.returncode:
                        raise RuntimeError(f"memory of {name}/{v} failed:\n{child.stderr}")
                    peak, params = json.loads(child.stdout.strip().splitlines()[-1])
                    peaks[v].append(peak / 2**20)
            extra = {v: float(np.median(peaks[v]) - np.median(peaks["plain"])) for v in variants}
            found.append(
                dict(
                    model=name,
                    allocator=allocator,
                    params=params,
                    param_mb=params * 4 / 2**20,
                    peak_rss_mb=peaks,
                    extra_mb=extra,
                )
            )
            log(f"  memory {name} ({allocator}): peak RSS over plain {extra}")
    return {"memory": found}


def memory_child(name, variant, specs, optimizer):
    """In a fresh process: train one variant 20 steps, print `[peak RSS
    bytes, parameters]` as JSON."""
    spec = specs[name]
    model, callback = models.keeping_model(variant, spec, initial_weights(spec), False, optimizer)
    tf_runner(model, callback, spec)(20)
    try:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps([peak, params_of(model)]))


SUBCOMMANDS = dict(
    keeping=keeping, memory=memory, metrics=metrics, dynamics=dynamics, tensorboard=tensorboard
)


# --- processes, backends and pooling --------------------------------------


def child_argv(argv, **options):
    """`argv` without `--processes`, `--backend` and `--out`, with `options`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--processes", "--backend", "--out"):
            skip = True
        elif not arg.startswith(("--processes=", "--backend=", "--out=")):
            out.append(arg)
    return out + [x for key, value in options.items() for x in (f"--{key}", str(value))]


def in_children(argv, options_list, backend):
    """Runs `run.py` once per `options`, one after another, on `backend`
    unless an `options` names one; yields their results."""
    with tempfile.TemporaryDirectory() as tmp:
        for k, options in enumerate(options_list):
            path = os.path.join(tmp, f"{k}.json")
            log(f"process {k + 1} of {len(options_list)}: {options}")
            env = dict(os.environ, KERAS_BACKEND=options.get("backend", backend))
            # The parent prints the pooled tables.
            cmd = [sys.executable, __file__, *child_argv(argv, out=path, **options)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
            with open(path) as f:
                yield json.load(f)


def _key(c):
    return tuple(str(c.get(k)) for k in ("model", "jit_compile", "batch_size", "setup", "replicas"))


def pool(results):
    """One result from runs of one subcommand and backend: the configs all
    of them timed, their processes' rounds pooled.

    Raises:
        ValueError: the runs differ in subcommand, backend or variants, or
            share no config.
    """
    for key in ("command", "backend", "optimizer"):
        if len({str(r.get(key)) for r in results}) > 1:
            raise ValueError(f"The runs to pool must share their `{key}`.")
    keys = [_key(c) for c in results[0]["configs"]]
    keys = [k for k in keys if all(k in map(_key, r["configs"]) for r in results[1:])]
    if not keys:
        raise ValueError("The runs to pool share no config (model, jit, batch size, setup).")
    pooled = dict(results[0], configs=[], complete=True)
    for key in keys:
        found = [next(c for c in r["configs"] if _key(c) == key) for r in results]
        if len({tuple(c["runs"][0]) for c in found}) > 1:
            raise ValueError(f"The runs to pool time different variants of {key[0]}.")
        first = dict(found[0], runs=[run for c in found for run in c["runs"]])
        summary = {k: first[k] for k in ("pairs", "targets", "tolerance", "measures") if k in first}
        first.update(stats.summarize(first["runs"], first["base"], **summary))
        pooled["configs"].append(first)
    pooled["memory"] = [m for r in results for m in r.get("memory", [])]
    return pooled


# --- tables ---------------------------------------------------------------


def _pct(x):
    return f"{x * 100:+.1f}%"


def _cell(d):
    found = f"{_pct(d['median'])} [{_pct(d['ci90'][0])}, {_pct(d['ci90'][1])}]"
    if "process_medians" in d:
        p, i = d["process_medians"], d["process_medians"]["interval"]
        found += f"; processes {_pct(p['median'])} [{_pct(i['low'])}, {_pct(i['high'])}]"
    return found


def _iqr(q):
    return f"{q['median']:.3f} [{q['q25']:.3f}, {q['q75']:.3f}]"


def markdown(result):
    if "backends" in result:
        return "\n\n".join(f"## {b}\n\n{markdown(r)}" for b, r in result["backends"].items())
    lines = []
    for c in result.get("configs", []):
        jit = f", jit {c['jit_compile']}" if "jit_compile" in c else ""
        lines += [
            f"### {c['model']}: {c['params']:,} parameters, batch {c['batch_size']}{jit}, "
            f"{c['processes']} process(es), {c['rounds']} rounds; base `{c['base']}`\n",
            "| variant | ms/step | ratio, wall [IQR] | ratio, CPU [IQR] | fastest rounds | "
            "beyond control, wall [90%] | beyond control, CPU [90%] | hooks ms/step | "
            "event bytes/step | heatmap ms/step |",
            "|---|---:|---|---|---:|---|---|---:|---:|---:|",
        ]
        for v, ms in c["step_ms"].items():
            hooks = c.get("hooks_seconds_per_step", {}).get(v)
            written = c.get("event_bytes_per_step", {}).get(v)
            drawn = c.get("heatmap_seconds_per_step", {}).get(v)
            lines.append(
                f"| {v} | {ms:.2f} | {_iqr(c['wall']['ratio'][v])} | {_iqr(c['cpu']['ratio'][v])} "
                f"| {c['wall']['fastest_ratio'][v]:.3f} | {_cell(c['wall']['beyond_control'][v])} "
                f"| {_cell(c['cpu']['beyond_control'][v])} | "
                f"{'' if hooks is None else f'{hooks * 1e3:.3f}'} | "
                f"{'' if written is None else f'{written:.0f}'} | "
                f"{'' if drawn is None else f'{drawn * 1e3:.3f}'} |"
            )
        for pair, d in c["wall"]["pairs"].items():
            cpu = c["cpu"]["pairs"][pair]
            lines.append(
                f"\n`{pair}` per round over the base: wall {_cell(d)}, CPU "
                f"{_cell(cpu)}; ratio, CPU {_iqr(cpu['ratio'])}"
            )
        if "batch_wall" in c:
            cells = ", ".join(
                f"{v} {_cell(d)}" for v, d in c["batch_wall"]["beyond_control"].items()
            )
            lines.append(f"\nbeyond control, wall without the heatmap [90%]: {cells}")
        steady = c.get("steady_event_bytes_per_step")
        if steady:
            base_bytes = steady[c["base"]]
            cells = ", ".join(f"{v} {b:.0f} (x{b / base_bytes:.2f})" for v, b in steady.items())
            lines.append(f"\nevent bytes per step, long runs (over `{c['base']}`): {cells}")
        for subject, v in c["verdicts"].items():
            line = f"\n{subject}: at most {_pct(v['target'])} beyond control: {v['budget']}"
            if "budget_per_batch" in v:
                line += f"; per batch, without the epoch's heatmap: {v['budget_per_batch']}"
            if "floor" in v:
                line += (
                    f"; against {v['floor']} (within {_pct(v['tolerance'])}): {v['against_floor']}"
                )
            lines.append(line)
        if "xla" in c:
            x = c["xla"]
            lines.append(
                f"\nXLA flops, plain {x['plain']['flops']:.0f}, kept "
                f"{x['kept']['flops']:.0f}; kept's extra bytes accessed in parameter "
                f"writes: {x['extra_bytes_in_parameter_writes']:.2f}"
            )
        lines.append("")
    for o in result.get("op_counts", []):
        extra = ", ".join(f"{k} x{n}" for k, n in o["kept_extra_ops"].items())
        lines.append(
            f"- ops of `train_step`, {o['model']}: plain {o['plain']}, keeping off "
            f"{o['off']}, kept {o['kept']}; kept adds {extra}"
        )
    for m in result.get("memory", []):
        extra = ", ".join(f"{v} {mb:+.1f} MB" for v, mb in m["extra_mb"].items() if v != "plain")
        lines.append(
            f"- peak RSS over plain, {m['model']} ({m['param_mb']:.1f} MB of "
            f"parameters, {m['allocator']} malloc): {extra}"
        )
    return "\n".join(lines)


# --- command line ---------------------------------------------------------


def _positive_int(text):
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more. Received: {text}")
    return int(text)


def make_parser():
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    mode = common.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny models, 2 rounds")
    mode.add_argument("--quick", action="store_true", help="a few minutes")
    add = common.add_argument
    add("--rounds", type=_positive_int, help="override the mode's rounds")
    add(
        "--processes",
        type=_positive_int,
        default=1,
        help="time in this many fresh processes, one after another, and pool their rounds",
    )
    add(
        "--threads",
        type=int,
        default=0,
        help="op threads (0: the default; PyTorch: any count; JAX: only 1)",
    )
    add("--models", nargs="+", help="only these models")
    add(
        "--variants",
        nargs="+",
        help="only these variants (keeping, metrics, memory: the base and control always run)",
    )
    add("--out", help="JSON path; default benchmarks/results/<subcommand>-<mode>.json")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = {
        name: sub.add_parser(
            name, parents=[common], allow_abbrev=False, help=fn.__doc__.split("\n")[0]
        )
        for name, fn in SUBCOMMANDS.items()
    }
    for name in ("keeping", "tensorboard", "dynamics"):
        p[name].add_argument(
            "--backend",
            choices=(*BACKENDS, "all"),
            help="default: KERAS_BACKEND or tensorflow; all: each in a fresh process",
        )
        p[name].add_argument("--steps", type=int, default=0, help="steps per pass or fit")
    for name in ("keeping", "memory"):
        p[name].add_argument("--optimizer", choices=tuple(models.OPTIMIZERS), default="adam")
    k = p["keeping"].add_argument
    k(
        "--jit",
        choices=("off", "on", "both", "auto"),
        help="default: both (smoke: off; JAX, PyTorch: auto)",
    )
    k(
        "--instances",
        type=_positive_int,
        default=1,
        help="model objects per variant, timed in turn and averaged",
    )
    k("--pass-seconds", type=float, help="base training time per pass")
    k("--passes", type=_positive_int, help="passes per round")
    k("--batch-size", type=_positive_int, help="override the models' batch size")
    k("--ops", action="store_true", help="also count the traced step's ops")
    for name in ("metrics", "dynamics"):
        p[name].add_argument(
            "--jit", action="store_true", help="jit_compile=True (default off; JAX: auto)"
        )
    for name in ("keeping", "dynamics"):
        p[name].add_argument(
            "--mirrored", action="store_true", help="MirroredStrategy on 2 logical CPUs"
        )
    p["tensorboard"].add_argument("--setup", choices=tuple(models.SETUPS), default="watched")
    p["memory"].add_argument("--allocators", nargs="+", choices=tuple(ALLOCATORS))
    p["memory"].add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    pooling = sub.add_parser("pool", help="time nothing: pool the JSON of earlier runs")
    pooling.add_argument("files", nargs="+")
    pooling.add_argument("--out")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser().parse_args(argv)
    started, mode = time.perf_counter(), "pooled"
    if args.command == "pool":
        results = []
        for path in args.files:
            with open(path) as f:
                results.append(json.load(f))
            if "configs" not in results[-1]:
                raise SystemExit(f"{path} is not the JSON of a `run.py` subcommand.")
        result = pool(results)
    else:
        mode = "smoke" if args.smoke else "quick" if args.quick else "full"
        backend = getattr(args, "backend", None) or os.environ.get("KERAS_BACKEND", "tensorflow")
        if backend == "all":
            runs = in_children(argv, [{"backend": b} for b in BACKENDS], backend)
            result = {"command": args.command, "backends": dict(zip(BACKENDS, runs))}
        elif args.processes > 1:
            result = pool(list(in_children(argv, [{"processes": 1}] * args.processes, backend)))
        else:
            result = measure(args, backend, mode)
        result.update(mode=mode, argv=argv)
    out = args.out or os.path.join(HERE, "results", f"{args.command}-{mode}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    log(f"wrote {out} in {time.perf_counter() - started:.0f}s")
    return result


def measure(args, backend, mode):
    """Times `args.command` here, on `backend`: its result."""
    if keras.backend.backend() != backend:
        raise SystemExit(f"Keras runs on {keras.backend.backend()} here, not {backend}.")
    if getattr(args, "mirrored", False):
        # Before TensorFlow runs any op, which fixes its devices.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    # One trace per model and iterator type is expected; TensorFlow's
    # "excessive retracing" warning counts them across models.
    tf.get_logger().setLevel("ERROR")
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
        if backend == "torch":
            import torch

            torch.set_num_threads(args.threads)
        elif backend == "jax" and args.threads != 1:
            raise SystemExit("On JAX `--threads` takes 1 (one XLA thread) or 0 (its default).")
    specs = models.SMOKE_MODELS if args.smoke else models.MODELS
    if args.command == "memory" and args.child:
        memory_child(*args.child, specs, args.optimizer)
        sys.exit(0)
    rounds, passes, seconds = MODES.get(args.command, {}).get(mode, (0, 1, 0.0))
    if args.command == "keeping":
        passes = args.passes or passes
        seconds = seconds if args.pass_seconds is None else args.pass_seconds
    result = {
        "command": args.command,
        "backend": backend,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(
            cpus=os.cpu_count(), platform=platform.platform(), loadavg=list(os.getloadavg())
        ),
        "versions": {
            "python": platform.python_version(),
            "keras": keras.__version__,
            backend: sys.modules[backend].__version__,
        },
        "threads": args.threads or "default",
    }
    result.update(SUBCOMMANDS[args.command](args, specs, (rounds, passes, seconds)))
    return result


if __name__ == "__main__":
    main()
