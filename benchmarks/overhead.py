"""What keeping gradients costs, measured against plain Keras.

Paired, interleaved rounds in one process. A round makes 2 passes over the
variants below, in orders rotated by one each round (`pass_order`: every
variant runs at every position, and first, equally often), and each
variant runs the same fixed number of training steps per pass (about
0.1 s of plain training: with 40 ms passes the 1M MLP's per-round ratios
had an IQR of about 6 points here, with 0.1 s about 4); the variant's
time in the round is its fastest pass (other processes on a shared
machine only ever add time). Each variant's round time is divided by the plain `keras.Model`'s time
of the same round; the tables report the median of these per-round ratios and
their interquartile range (IQR) as the "overhead beyond control": the median
over rounds of `ratio(variant) - ratio(control)`, where the control is a
second, identical plain `keras.Model` (its ratio is 1 up to noise and order
effects). Wall time is the measure; the process CPU time is reported too.
A bootstrap (`bootstrap`) gives a 90% interval of each median; the target
is called met or missed only when the whole interval is on one side of it.
With `--instances K`, each variant is K separate model objects, timed in
turn, and a round's time of the variant is the mean of theirs: one model
object can be persistently a few percent faster or slower than an identical
one in the same process (seen with the embedding model), which more rounds
do not average out. With `--processes P`, the whole timing runs in P fresh
processes, one after another; their rounds are pooled, and the bootstrap
draws processes before rounds, so with several processes the interval also
covers what differs between whole processes (the machine's state while
each ran, whatever a process's own start leaves behind), which no number
of rounds or objects within one process averages out. `--combine A.json
B.json` times nothing and pools the processes of such runs made apart.

Variants (all with the same initial weights, `Adam` or with `--optimizer
sgd` `SGD`, the same batch):

- `plain`: `keras.Model`.
- `control`: a second `keras.Model`, the noise control.
- `kept`: `kg.KeepGradModel` (keeps every step).
- `every10`: `kg.KeepGradModel(..., keep_every=10)`.
- `hand`: a hand-written custom `train_step` that assigns each gradient to a
  `tf.Variable` (what a user can write without this library).
- `floor`: a reference point, the issue's "one parameter-sized write per
  step" and nothing else: Keras's own `train_step`, then a copy of each
  trainable variable (just updated, as a gradient is just computed) into a
  `tf.Variable`. Without XLA the assign itself shares the weight's buffer,
  and the copy happens in the next step's in-place update of the weight
  (copy-on-write); for a variable a sparse update has touched (the
  embedding table with `--optimizer sgd`), in the read instead. The targets
  stay overhead beyond the control; the tables also give kept's overhead
  beyond the floor, the median of per-round
  `(time(kept) - time(floor)) / time(plain)`. Where kept writes less than
  the parameters (sparse rows, as with `--optimizer sgd` on the embedding
  model) it can be negative.
- `recompute`: a plain model plus a callback that recomputes the gradients
  with a separate `tf.GradientTape` forward and backward pass per batch (in
  a `tf.function`), as `WandbCallback(log_gradients=True)`-style logging does.

Steps run through `model.train_function` on a pre-made iterator over a
repeated batch, after a warm-up `fit`, so tracing and XLA compilation are
excluded; the recompute callback is called after each step as `fit` calls
it. Also reported: the op counts of the traced `train_step` graphs of a plain
model, a `KeepGradModel(keep_gradients=False)` and a `KeepGradModel`, and the
peak RSS of separate subprocesses training a plain model, a kept one and (in
full mode) the hand-written one, under a few allocator settings.

Usage:

```shell
python benchmarks/overhead.py            # full: 100 rounds, about 35 min
python benchmarks/overhead.py --instances 2   # as in the README: over 1 h
python benchmarks/overhead.py --models mlp_1m --jit off --processes 6 \
    --instances 2 --rounds 30 --no-memory --no-ops   # about 10 min
python benchmarks/overhead.py --quick    # under 3 minutes on 2 cores
python benchmarks/overhead.py --smoke    # tiny models, 2 rounds (tests)
```

Results are printed as Markdown tables and written as JSON to
`benchmarks/results/overhead-<mode>.json` (or `--out`), rewritten after each
measurement with `"complete": false` until the run ends.

Do not edit `keras_keepgrad/` while a run is going: TensorFlow's autograph
reads a function's source file when it first traces it, so a later trace
can convert code that is no longer what was imported.
"""

import argparse
import collections
import datetime
import gc
import json
import os
import platform
import resource
import subprocess
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

VARIANTS = ("plain", "control", "kept", "every10", "hand", "floor", "recompute")

# Median overhead beyond the control that keeping may cost (issue 7).
TARGETS = {"mlp_1m": 0.02, "conv": 0.02, "mlp_10m": 0.03, "embedding": 0.03}
RECOMPUTE_FACTOR = 10.0

MODES = {
    # Each round times `passes` interleaved passes over the variants, each
    # variant running about `pass_seconds` of steps per pass.
    "full": dict(
        rounds=100,
        passes=2,
        pass_seconds=0.1,
        memory_pairs=3,
        memory_models=("mlp_10m", "embedding"),
        memory_allocators=("mmap", "default", "mmap-no-onednn"),
        memory_variants=("plain", "kept", "hand"),
    ),
    # Quick: only the variants the targets need (each one is built, traced
    # and XLA-compiled per config, which dominates a short run).
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


# --- models ------------------------------------------------------------


def _mlp(width_in, hidden, classes):
    def build():
        inputs = keras.Input((width_in,))
        h = inputs
        for i, units in enumerate(hidden):
            h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
        return inputs, keras.layers.Dense(classes, name="logits")(h)

    return build


def _conv(size, filters, dense):
    def build():
        inputs = keras.Input((size, size, 3))
        h = inputs
        for i, f in enumerate(filters):
            h = keras.layers.Conv2D(f, 3, activation="relu", name=f"conv_{i}")(h)
            h = keras.layers.MaxPooling2D(name=f"pool_{i}")(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(dense, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return build


def _embedding(vocab, dim, length):
    def build():
        inputs = keras.Input((length,), dtype="int32")
        h = keras.layers.Embedding(vocab, dim, name="embedding")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        h = keras.layers.Dense(64, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return build


def model_specs(smoke):
    """`{name: (build, batch_size, make_x)}`; `make_x(rng, batch)` -> x."""
    if smoke:
        return {
            "mlp_1m": (_mlp(16, [32], 10), 8, lambda r, b: r.random((b, 16), "float32")),
            "embedding": (
                _embedding(100, 4, 5),
                8,
                lambda r, b: r.integers(0, 100, (b, 5)).astype("int32"),
            ),
        }
    return {
        # 512*1024 + 1024*512 + 512*10 (+ biases) = 1.06M parameters.
        "mlp_1m": (_mlp(512, [1024, 512], 10), 128, lambda r, b: r.random((b, 512), "float32")),
        # 1024*2048 + 2*2048*2048 + 2048*10 (+ biases) = 10.5M parameters.
        "mlp_10m": (
            _mlp(1024, [2048, 2048, 2048], 10),
            128,
            lambda r, b: r.random((b, 1024), "float32"),
        ),
        # CIFAR-sized: conv 32, conv 64, dense 128: 0.32M parameters.
        "conv": (_conv(32, [32, 64], 128), 64, lambda r, b: r.random((b, 32, 32, 3), "float32")),
        # Embedding(50_000, 64): 3.2M parameters, sparse gradient of
        # batch * length = 4096 rows.
        "embedding": (
            _embedding(50_000, 64, 64),
            64,
            lambda r, b: r.integers(0, 50_000, (b, 64)).astype("int32"),
        ),
    }


class _Holder:
    """Holds slot variables out of sight of Keras's attribute tracking."""

    def __init__(self, items):
        self.items = items


class _WithSlots(keras.Model):
    def make_slots(self):
        """One `tf.Variable` per trainable variable, made before training."""
        self._slots = _Holder(
            [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                for v in self.trainable_variables
            ]
        )


class HandKeptModel(_WithSlots):
    """The best a user writes by hand: a `train_step` that keeps gradients.

    As the Keras guide "Customizing what happens in fit()" writes a
    `train_step`, plus one `assign` per variable into a `tf.Variable` made
    beforehand (sparse gradients densified, as `tf.Variable.assign` needs).
    """

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        for slot, grad in zip(self._slots.items, grads):
            slot.assign(tf.convert_to_tensor(grad))
        self.optimizer.apply(grads, variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class FloorModel(_WithSlots):
    """Keras's own `train_step`, then one parameter-sized write.

    Each trainable variable's new value is copied into a `tf.Variable`: the
    floor of keeping anything, with no gradient involved. (Without XLA the
    assign shares the weight's buffer, and the next update of the weight
    copies it before changing it in place; after a sparse update, the read
    copies.)
    """

    def train_step(self, data):
        logs = super().train_step(data)
        for slot, variable in zip(self._slots.items, self.trainable_variables):
            slot.assign(variable.value, read_value=False)
        return logs


class RecomputeGradients(keras.callbacks.Callback):
    """Recomputes the batch's gradients after each step, in a `tf.function`.

    A separate forward and backward pass, as gradient-logging callbacks
    (`WandbCallback(log_gradients=True)` and the like) do today.
    """

    def __init__(self, batch, loss_fn, jit_compile):
        super().__init__()
        self.batch = batch
        self.loss_fn = loss_fn
        self.jit_compile = jit_compile
        self.gradients = None
        self._fn = None

    def _grads(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        return tape.gradient(loss, self.model.trainable_variables)

    def on_train_batch_end(self, batch, logs=None):
        if self._fn is None:
            self._fn = tf.function(self._grads, jit_compile=self.jit_compile)
        self.gradients = self._fn(*self.batch)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# `--optimizer`: Keras's Adam updates a whole embedding table every step
# (the step is optimizer-bound); SGD updates only the batch's rows.
OPTIMIZERS = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}
OPTIMIZER = "adam"


def new_variant(variant, build, batch, jit_compile, weights=None):
    """A compiled, untrained variant: `(model, callback or None)`.

    `weights` (from `get_weights()`) gives every variant the same start.
    """
    inputs, outputs = build()
    if variant in ("plain", "control", "recompute"):
        model = keras.Model(inputs, outputs)
    elif variant == "kept":
        model = kg.KeepGradModel(inputs, outputs)
    elif variant == "every10":
        model = kg.KeepGradModel(inputs, outputs, keep_every=10)
    elif variant == "off":
        model = kg.KeepGradModel(inputs, outputs, keep_gradients=False)
    elif variant in ("hand", "floor"):
        model = {"hand": HandKeptModel, "floor": FloorModel}[variant](inputs, outputs)
        model.make_slots()
    else:
        raise ValueError(f"Unknown variant: {variant!r}")
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=OPTIMIZERS[OPTIMIZER](1e-4), loss=_loss(), jit_compile=jit_compile)
    callback = None
    if variant == "recompute":
        callback = RecomputeGradients(batch, _loss(), jit_compile)
    return model, callback


def fit_briefly(model, callback, batch):
    """Two `fit` steps (which trace), then `(model, iterator, callback)`."""
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    model.fit(
        dataset,
        steps_per_epoch=2,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[callback] if callback else None,
    )
    # The iterator type `fit` uses, so `train_function` is not retraced.
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
    return model, iterator, callback


def make_variant(variant, build, batch, jit_compile, weights=None):
    """A compiled variant, fitted for 2 steps: `(model, iterator, callback)`.

    Call `warm_up` on all variants only after building the last one:
    building may seed, and `tf.random.set_seed` clears TensorFlow's kernel
    caches, which would put a first-call cost into the timed rounds.
    """
    model, callback = new_variant(variant, build, batch, jit_compile, weights)
    return fit_briefly(model, callback, batch)


def warm_up(model, iterator, callback):
    """Traces `train_function` for this iterator type, outside the timing."""
    run_steps(model, iterator, callback, 3)


def run_steps(model, iterator, callback, steps):
    """`(wall, cpu)` seconds of `steps` training steps (callback as in `fit`).

    The CPU time is that of the whole process (all TensorFlow threads): less
    disturbed than the wall time by other processes on a shared machine.
    """
    train_function = model.train_function
    start, start_cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        logs = train_function(iterator)
        if callback is not None:
            callback.on_train_batch_end(step, logs)
    float(logs["loss"])  # the step's outputs exist: it has finished
    return time.perf_counter() - start, time.process_time() - start_cpu


# --- statistics ----------------------------------------------------------


def _summary(values):
    q25, median, q75 = np.percentile(np.asarray(values, dtype="float64"), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def summarize(times):
    """Per-round ratios against `plain`, and overhead beyond `control`."""
    plain = np.asarray(times["plain"])
    control = np.asarray(times["control"]) / plain
    out = {"ratio": {}, "beyond_control": {}}
    for variant, seconds in times.items():
        ratio = np.asarray(seconds) / plain
        out["ratio"][variant] = _summary(ratio)
        out["beyond_control"][variant] = _summary(ratio - control)
    if "kept" in times and "floor" in times:
        out["kept_beyond_floor"] = _summary(
            (np.asarray(times["kept"]) - np.asarray(times["floor"])) / plain
        )
    return out


BOOTSTRAP_SAMPLES = 2000
KEPT_BEYOND_FLOOR = "kept - floor"


def _instances(fastest, variant="plain"):
    return sum(1 for v, _ in fastest if v == variant)


def bootstrap(runs, variants, seed=0, samples=BOOTSTRAP_SAMPLES):
    """Bootstrap replicates of each variant's median overhead beyond control.

    `runs` holds one `fastest` per process (one, unless `--processes`):
    `fastest[variant, i]`, instance i's seconds per step in each round. A
    replicate draws the rounds with replacement (the same draw for every
    variant: rounds are paired) and, for each variant separately, its
    instances with replacement, then computes the overhead as `summarize`
    does. With `--instances` above 1 the spread between model objects (which
    more rounds do not average out) is thus in the interval. With several
    runs, a replicate first draws the processes with replacement, then the
    rounds and instances within each drawn one, and pools the drawn rounds:
    what differs between whole processes is then in the interval too.

    Returns `{variant: array of samples}`, plus under `KEPT_BEYOND_FLOOR`
    those of kept's median overhead beyond the floor variant's, where both
    ran (as `summarize`'s `kept_beyond_floor`).
    """
    rng = np.random.default_rng(seed)
    times = [
        {v: np.stack([f[v, i] for i in range(_instances(f, v))]) for v in variants} for f in runs
    ]
    floor = "kept" in variants and "floor" in variants
    out = {v: np.empty(samples) for v in variants}
    if floor:
        out[KEPT_BEYOND_FLOOR] = np.empty(samples)
    for b in range(samples):
        chosen = rng.integers(0, len(runs), len(runs)) if len(runs) > 1 else [0]
        parts = []
        for k in chosen:
            rounds = times[k]["plain"].shape[1]
            picked = rng.integers(0, rounds, rounds)
            parts.append(
                {
                    v: t[rng.integers(0, len(t), len(t))][:, picked].mean(axis=0)
                    for v, t in times[k].items()
                }
            )
        mean = {v: np.concatenate([part[v] for part in parts]) for v in variants}
        control = mean["control"] / mean["plain"]
        for v in variants:
            out[v][b] = np.median(mean[v] / mean["plain"] - control)
        if floor:
            out[KEPT_BEYOND_FLOOR][b] = np.median((mean["kept"] - mean["floor"]) / mean["plain"])
    return out


def intervals(samples, target):
    """90% intervals from `bootstrap` samples, the target's verdict, and a
    lower bound (5th percentile) of recompute / kept.

    The interval of kept beyond the floor (None without both) is under
    `kept_beyond_floor_ci90`, not among the variants' in `ci90`.
    """
    ci = {v: [float(q) for q in np.percentile(s, [5, 95])] for v, s in samples.items()}
    beyond_floor = ci.pop(KEPT_BEYOND_FLOOR, None)
    out = {
        "ci90": ci,
        "target_verdict": None,
        "recompute_over_kept_low": None,
        "kept_beyond_floor_ci90": beyond_floor,
    }
    if "kept" in ci and target is not None:
        low, high = ci["kept"]
        out["target_verdict"] = (
            "met" if high <= target else "missed" if low > target else "undecided"
        )
    if "kept" in samples and "recompute" in samples:
        kept, recompute = samples["kept"], samples["recompute"]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.where(kept > 0, recompute / kept, np.inf)
        low = float(np.percentile(factor, 5))
        # JSON has no infinity: None where kept measured no slower than the
        # control in over 95% of the replicates.
        out["recompute_over_kept_low"] = low if np.isfinite(low) else None
    return out


def fastest_from(config):
    """`{(variant, instance): array[rounds, 2]}`: each round's fastest pass
    (wall, CPU seconds per step) of each instance, from a config's
    `pass_seconds_per_step`. The wall and CPU minima are taken separately
    (they can come from different passes), alike for every variant."""
    return {
        (v, i): np.asarray(passes).min(axis=1)
        for v, per_instance in config["pass_seconds_per_step"].items()
        for i, passes in enumerate(per_instance)
    }


def config_result(runs, variants, target):
    """Step times, overheads, intervals and verdicts of one config.

    `runs`: per process, `{(variant, instance): array[rounds, 2]}` of seconds
    per step (wall, CPU) in each round, the fastest pass of each. A round's
    time of an instance is its fastest pass, the one least slowed by other
    processes (interference only ever adds time). A variant's: the mean over
    its instances, which averages out what makes one model object
    persistently faster or slower than an identical one (where its buffers
    landed): within a process that effect does not average out over rounds.
    The rounds of several runs are pooled, in turn.
    """

    def per_round(column):
        return {
            v: np.concatenate(
                [
                    np.mean([f[v, i][:, column] for i in range(_instances(f, v))], axis=0)
                    for f in runs
                ]
            )
            for v in variants
        }

    wall, cpu = per_round(0), per_round(1)
    result = {
        "step_ms": {v: float(np.median(ts) * 1e3) for v, ts in wall.items()},
        "seconds_per_step": {v: [float(t) for t in ts] for v, ts in wall.items()},
        "cpu_seconds_per_step": {v: [float(t) for t in ts] for v, ts in cpu.items()},
    }
    result.update(summarize(wall))
    cpu_summary = summarize(cpu)
    result["cpu_ratio"] = cpu_summary["ratio"]
    result["cpu_beyond_control"] = cpu_summary["beyond_control"]
    if "kept_beyond_floor" in cpu_summary:
        result["cpu_kept_beyond_floor"] = cpu_summary["kept_beyond_floor"]
    result["target"] = target
    for key, column in (("wall", 0), ("cpu", 1)):
        samples = bootstrap([{k: t[:, column] for k, t in f.items()} for f in runs], variants)
        result[f"{key}_intervals"] = intervals(samples, target)
    result["meets_target"] = result["recompute_over_kept"] = None
    result["meets_recompute_factor"] = None
    if "kept" in wall:
        kept = result["beyond_control"]["kept"]["median"]
        if target is not None:
            result["meets_target"] = bool(kept <= target)
        if "recompute" in wall:
            recompute = result["beyond_control"]["recompute"]["median"]
            # None: keeping measured no slower than the control.
            result["recompute_over_kept"] = float(recompute / kept) if kept > 0 else None
            result["meets_recompute_factor"] = bool(
                kept <= 0 or recompute >= RECOMPUTE_FACTOR * kept
            )
    return result


def pass_order(keys, r, p, passes):
    """The order in which pass `p` of round `r` times `keys`.

    A rotation by `r`, plus an offset per pass that spreads a round's passes
    over the rotation: for each pass, over `len(keys)` rounds every key runs
    once at each position, in particular first (right after the round's
    `gc.collect()`, a slow spot). Rotating by `r * passes + p` instead, as
    before, put with an even number of keys and 2 passes only every other
    key first in pass 0: with 4 variants (`--variants kept floor`), `plain`
    and `kept` always, `control` and `floor` never.
    """
    n = len(keys)
    shift = (r + p * max(1, n // passes)) % n
    return keys[shift:] + keys[:shift]


def time_config(name, spec, jit_compile, mode, variants, log):
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
        entries[variant, i] = make_variant(variant, build, batch, jit_compile, weights)
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


def combine_processes(runs):
    """One config per model and jit from the results of several processes.

    Each config pools the rounds of all processes (`config_result`) and
    bootstraps over processes too (`bootstrap`); `per_process` keeps
    what each process measured alone. Unlike a config timed in one process,
    it has `steps_per_pass_by_process` (steps are sized in each process)
    and no `pass_seconds_per_step` (each process's is in `process_runs`).
    """
    configs = []
    variants = runs[0]["variants"]
    for c, first in enumerate(runs[0]["configs"]):
        per = [run["configs"][c] for run in runs]
        if len({(p["model"], p["jit_compile"]) for p in per}) != 1:
            raise ValueError(f"The processes timed different configs at {c}.")
        config = {
            key: first[key]
            for key in (
                "model",
                "jit_compile",
                "params",
                "param_mb",
                "batch_size",
                "instances",
                "passes_per_round",
            )
        }
        config["processes"] = len(per)
        config["rounds"] = sum(p["rounds"] for p in per)
        config["steps_per_pass_by_process"] = [p["steps_per_pass"] for p in per]
        config.update(config_result([fastest_from(p) for p in per], variants, first["target"]))
        config["per_process"] = [
            {
                "kept_beyond_control": p["beyond_control"].get("kept"),
                "kept_ci90": p["wall_intervals"]["ci90"].get("kept"),
                "kept_beyond_floor": p.get("kept_beyond_floor"),
                "plain_step_ms": p["step_ms"]["plain"],
            }
            for p in per
        ]
        configs.append(config)
    return configs


def combine_files(paths):
    """Pools the processes of earlier `--processes` runs, from their JSON.

    Every process must have timed the same variants with the same
    optimizer; the configs (model, jit, batch size) that every process
    timed are pooled (`combine_processes`), in the first process's order,
    and the others dropped: a run of both jit modes combines with a run of
    one into that one.

    Raises:
        ValueError: A file holds no process runs, or the runs differ in
            their variants or optimizer, or share no config.
    """
    runs = []
    for path in paths:
        with open(path) as f:
            found = json.load(f).get("process_runs")
        if not found:
            raise ValueError(
                f"{path} holds no process runs: `--combine` takes the JSON "
                "files of runs made with `--processes` 2 or more."
            )
        runs += found
    for key in ("variants", "optimizer"):
        if len({json.dumps(run[key]) for run in runs}) != 1:
            raise ValueError(f"The runs to combine differ in their {key}.")

    def key(config):
        return config["model"], config["jit_compile"], config["batch_size"]

    common = [
        key(c)
        for c in runs[0]["configs"]
        if all(key(c) in {key(d) for d in run["configs"]} for run in runs)
    ]
    if not common:
        raise ValueError("The runs to combine share no config (model, jit, batch size).")
    runs = [
        dict(run, configs=[next(c for c in run["configs"] if key(c) == k) for k in common])
        for run in runs
    ]
    return {
        "mode": "combined",
        "sources": list(paths),
        "variants": runs[0]["variants"],
        "optimizer": runs[0]["optimizer"],
        "configs": combine_processes(runs),
        "op_counts": [],
        "memory": [],
        "process_runs": runs,
        "complete": True,
    }


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
                [sys.executable, os.path.abspath(__file__), *child_args(argv, path)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with open(path) as f:
                yield json.load(f)


# --- op counts -------------------------------------------------------------


def op_counts(name, spec):
    """Ops in the traced `train_step` graph: plain, keep off, keep on."""
    build, batch_size, make_x = spec
    rng = np.random.default_rng(0)
    x = make_x(rng, batch_size)
    y = rng.integers(0, 10, (batch_size,)).astype("int32")
    batch = (tf.constant(x), tf.constant(y))
    data_spec = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    counts = {}
    keras.utils.set_random_seed(0)
    for variant in ("plain", "off", "kept"):
        model = make_variant(variant, build, batch, jit_compile=False)[0]
        graph = tf.function(model.train_step).get_concrete_function(data_spec).graph
        counts[variant] = collections.Counter(op.type for op in graph.get_operations())
    keras.backend.clear_session()
    extra = counts["kept"] - counts["plain"]
    return {
        "model": name,
        "plain": sum(counts["plain"].values()),
        "off": sum(counts["off"].values()),
        "kept": sum(counts["kept"].values()),
        "off_equals_plain": counts["off"] == counts["plain"],
        "kept_extra_ops": dict(sorted(extra.items())),
        "kept_missing_ops": dict(sorted((counts["plain"] - counts["kept"]).items())),
    }


# --- memory --------------------------------------------------------------


def _status_bytes(field):
    """`VmHWM` (peak RSS) or `VmRSS` of this process, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field == "VmHWM":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None


def _reset_peak_rss():
    """Restarts `VmHWM` from the current RSS (Linux 4.0+); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(name, variant, smoke, steps):
    """Runs in a subprocess: train one model, print its RSS figures as JSON.

    `peak_rss`: the process's peak RSS. `training_growth`: the peak during
    `fit` and the training steps over the RSS just before (the model built
    and compiled), which leaves out the import and build peaks.
    """
    build, batch_size, make_x = model_specs(smoke)[name]
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(make_x(rng, batch_size)),
        tf.constant(rng.integers(0, 10, (batch_size,)).astype("int32")),
    )
    keras.utils.set_random_seed(0)
    model, callback = new_variant(variant, build, batch, jit_compile=False)
    gc.collect()
    peak_before = _status_bytes("VmHWM")
    rss_before = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
    run_steps(*fit_briefly(model, callback, batch), steps)
    peak = _status_bytes("VmHWM")
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    print(
        json.dumps(
            {
                "peak_rss": max(peak, peak_before),
                "training_growth": peak - rss_before if reset and rss_before else None,
                "params": params,
            }
        )
    )


# glibc keeps freed memory below a threshold that grows with the sizes it
# sees (up to 32 MB): a tensor freed may stay resident, and the peak RSS then
# measures the allocator's history as much as the live buffers. With a fixed
# low threshold every large tensor is its own mapping, returned on free.
# "mmap-no-onednn" also turns off TensorFlow's oneDNN ops, whose buffers make
# the rest of the difference (seen on tensorflow-cpu 2.21).
ALLOCATORS = {
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    "default": {},
    "mmap-no-onednn": {"MALLOC_MMAP_THRESHOLD_": "65536", "TF_ENABLE_ONEDNN_OPTS": "0"},
}


def measure_memory(name, pairs, smoke, log, allocator="mmap", variants=("plain", "kept")):
    """RSS figures of fresh processes training each of `variants`."""
    variants = list(variants)
    env = dict(os.environ, **ALLOCATORS[allocator])
    records = {v: [] for v in variants}
    for i in range(pairs):
        # One process at a time: how a step's ops overlap, and so its peak,
        # changes when processes compete for the cores.
        shift = i % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-child",
                name,
                variant,
                "--steps",
                "20",
                "--optimizer",
                OPTIMIZER,
            ]
            if smoke:
                cmd.append("--smoke")
            child = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if child.returncode:
                raise RuntimeError(f"memory child {name}/{variant} failed:\n{child.stderr}")
            records[variant].append(json.loads(child.stdout.strip().splitlines()[-1]))
    mb = 2**20
    params = records["plain"][0]["params"]
    result = {
        "model": name,
        "allocator": allocator,
        "allocator_env": ALLOCATORS[allocator],
        "params": params,
        "param_mb": params * 4 / mb,
        "pairs": pairs,
        "peak_rss_mb": {v: [r["peak_rss"] / mb for r in rs] for v, rs in records.items()},
        "training_growth_mb": {
            v: [None if r["training_growth"] is None else r["training_growth"] / mb for r in rs]
            for v, rs in records.items()
        },
    }

    def extra(key, variant="kept"):
        values = result[key]
        if any(x is None for x in values[variant] + values["plain"]):
            return None
        return float(np.median(values[variant]) - np.median(values["plain"]))

    result["extra_mb"] = extra("peak_rss_mb")
    result["extra_training_growth_mb"] = extra("training_growth_mb")
    if "hand" in variants:
        result["hand_extra_mb"] = extra("peak_rss_mb", "hand")
        result["hand_extra_training_growth_mb"] = extra("training_growth_mb", "hand")
    log(
        f"  memory {name} ({allocator}): kept - plain peak RSS "
        f"{result['extra_mb']:+.1f} MB, growth in training "
        f"{result['extra_training_growth_mb']} MB; parameters "
        f"{result['param_mb']:.1f} MB"
    )
    return result


# --- report --------------------------------------------------------------


def code_state():
    """The commit benchmarked, and whether the package differs from it."""

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {
        "commit": git("rev-parse", "HEAD"),
        "package_changes": git("status", "--porcelain", "--", "keras_keepgrad"),
        "keras_keepgrad": kg.__version__,
    }


def machine_state():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "platform": platform.platform(),
    }


def _pct(value):
    return f"{value * 100:+.1f}%"


def _iqr(s):
    return f"{_pct(s['median'])} [{_pct(s['q25'])}, {_pct(s['q75'])}]"


_TITLES = {
    "kept": "kept",
    "every10": "kept, keep_every=10",
    "hand": "hand-written train_step",
    "floor": "floor (one weight copy)",
    "recompute": "recompute in callback",
}


def _timing_table(results, seconds_key, ratio_key, beyond_key, intervals_key, floor_key):
    shown = [v for v in results["variants"] if v in _TITLES]
    floor = "kept" in shown and "floor" in shown
    lines = [
        "| model | params | batch | jit | plain ms/step | control | "
        + " | ".join(_TITLES[v] for v in shown)
        + (" | kept beyond floor [90% interval]" if floor else "")
        + " | recompute / kept (5th pct.) | kept: 90% interval | target |",
        "|---" * (9 + len(shown) + floor) + "|",
    ]
    for r in results["configs"]:
        beyond = r[beyond_key]
        kept = beyond["kept"]["median"] if "kept" in beyond else None
        factor = ""
        if kept is not None and "recompute" in beyond:
            recompute = beyond["recompute"]["median"]
            factor = f"{recompute / kept:.0f}x" if kept > 0 else "inf (kept <= control)"
        found = r.get(intervals_key) or {}
        if factor and found.get("recompute_over_kept_low") is not None:
            factor += f" ({found['recompute_over_kept_low']:.0f}x)"
        interval = ""
        if "kept" in found.get("ci90", {}):
            low, high = found["ci90"]["kept"]
            interval = f"{_pct(low)} to {_pct(high)}"
        target = ""
        if kept is not None and r["target"] is not None:
            met = "met" if kept <= r["target"] else "MISSED"
            target = f"<= {r['target'] * 100:.0f}%: median {met}"
            if found.get("target_verdict"):
                target += f", interval: {found['target_verdict']}"
        beyond_floor = ""
        if floor:
            beyond_floor = f" | {_pct(r[floor_key]['median'])}"
            if found.get("kept_beyond_floor_ci90"):
                low, high = found["kept_beyond_floor_ci90"]
                beyond_floor += f" [{_pct(low)}, {_pct(high)}]"
        control = {k: v - 1 for k, v in r[ratio_key]["control"].items()}
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['batch_size']} | "
            f"{'on' if r['jit_compile'] else 'off'} | "
            f"{np.median(r[seconds_key]['plain']) * 1e3:.2f} | "
            f"{_iqr(control)} | "
            + " | ".join(_iqr(beyond[v]) for v in shown)
            + beyond_floor
            + f" | {factor} | {interval} | {target} |"
        )
    return lines


def markdown(results):
    """The results as Markdown tables."""
    lines = []
    if results["configs"]:
        lines += ["Wall time:", ""]
        lines += _timing_table(
            results,
            "seconds_per_step",
            "ratio",
            "beyond_control",
            "wall_intervals",
            "kept_beyond_floor",
        )
        lines += ["", "Process CPU time (all threads):", ""]
        lines += _timing_table(
            results,
            "cpu_seconds_per_step",
            "cpu_ratio",
            "cpu_beyond_control",
            "cpu_intervals",
            "cpu_kept_beyond_floor",
        )
        lines += [
            "",
            "Cells: median over rounds [interquartile range]. `control`: the "
            "second plain model's time over plain's, minus 1. Other columns: "
            "overhead beyond the control, the median of per-round "
            "`time(variant) / time(plain) - time(control) / time(plain)`. "
            "Interval: a bootstrap 90% interval of kept's median (rounds and, "
            "with several instances, model objects resampled; with several "
            "processes, the processes first); recompute / "
            "kept in parentheses: the bootstrap's 5th percentile. Target "
            "verdict by interval: met (all of it within the target), missed "
            "(all of it beyond), undecided (it spans the target). Kept beyond "
            "floor: the median of per-round `(time(kept) - time(floor)) / "
            "time(plain)`, with its bootstrap 90% interval.",
        ]
    runs = [c for c in results["configs"] if "per_process" in c]
    if runs:
        lines += [
            "",
            "Each process alone (`--processes`), kept beyond the control, "
            "wall time, median [its 90% interval]:",
            "",
        ]
        for c in runs:
            cells = []
            for p in c["per_process"]:
                kept = p["kept_beyond_control"]
                cell = "?" if kept is None else _pct(kept["median"])
                if p["kept_ci90"]:
                    cell += f" [{_pct(p['kept_ci90'][0])}, {_pct(p['kept_ci90'][1])}]"
                cells.append(cell)
            lines.append(
                f"- {c['model']}, jit {'on' if c['jit_compile'] else 'off'}: " + ", ".join(cells)
            )
    if results.get("op_counts"):
        lines += [
            "",
            "| model | plain ops | keep_gradients=False ops | kept ops | "
            "off == plain | extra ops when kept |",
            "|---|---|---|---|---|---|",
        ]
        for o in results["op_counts"]:
            extra = ", ".join(f"{k} x{v}" for k, v in o["kept_extra_ops"].items())
            lines.append(
                f"| {o['model']} | {o['plain']} | {o['off']} | {o['kept']} | "
                f"{'yes' if o['off_equals_plain'] else 'NO'} | {extra} |"
            )
    if results.get("memory"):
        lines += [
            "",
            "| model | malloc | parameter MB | peak RSS MB, plain | kept | extra | "
            "growth in training MB, plain | kept | extra |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def cells(values, extra):
            def fmt(xs):
                return ", ".join("?" if x is None else f"{x:.0f}" for x in xs)

            extra = "?" if extra is None else f"{extra:+.1f}"
            return f"{fmt(values['plain'])} | {fmt(values['kept'])} | {extra}"

        for m in results["memory"]:
            lines.append(
                f"| {m['model']} | {m['allocator']} | {m['param_mb']:.1f} | "
                f"{cells(m['peak_rss_mb'], m['extra_mb'])} | "
                f"{cells(m['training_growth_mb'], m['extra_training_growth_mb'])} |"
            )
        hand = [m for m in results["memory"] if "hand_extra_mb" in m]
        if hand:
            lines += [
                "",
                "Hand-written train_step keeping gradients (slots made "
                "before training), over plain:",
                "",
            ]
            lines += [
                f"- {m['model']} ({m['allocator']} malloc): peak RSS "
                f"{m['hand_extra_mb']:+.1f} MB, growth in training "
                f"{m['hand_extra_training_growth_mb']:+.1f} MB "
                f"(runs: {', '.join(f'{x:.0f}' for x in m['peak_rss_mb']['hand'])} MB)"
                for m in hand
            ]
    return "\n".join(lines)


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
    global OPTIMIZER
    OPTIMIZER = args.optimizer

    if args.memory_child:
        memory_child(*args.memory_child, smoke=args.smoke, steps=args.steps)
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
    mode = dict(MODES[mode_name])
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
        "optimizer": OPTIMIZER,
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

    log(f"mode={mode_name}, rounds={mode['rounds']}, optimizer={OPTIMIZER}, load={os.getloadavg()}")
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
            results["op_counts"].append(op_counts(name, specs[name]))
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
