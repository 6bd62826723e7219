"""Paired rounds of training steps, for what gradient metrics cost.

Used by `metric_overhead.py` and `dynamics_overhead.py`. Each variant is a
`KeepGradModel` MLP compiled with its own gradient metrics, from the same
initial weights, trained on one repeated batch. Every round times the same
number of steps of each variant, in an order rotated by one each round, so
that slow drifts of a shared machine hit every variant alike; a variant's
time in a round is divided by that round's `reference` time, and its
overhead is the median over rounds of `ratio(variant) - ratio(control)`,
`control` being a second model without metrics.
"""

import gc
import time

import keras
import numpy as np
import tensorflow as tf
from overhead_stats import quartiles

import keras_keepgrad as kg


def build_mlp(sizes):
    """`sizes[0]` inputs, ReLU layers of `sizes[1:-1]` units, `sizes[-1]` logits."""
    inputs = keras.Input((sizes[0],))
    h = inputs
    for i, units in enumerate(sizes[1:-1]):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    return kg.KeepGradModel(inputs, keras.layers.Dense(sizes[-1], name="logits")(h))


def make_variant(metrics, sizes, batch, weights, jit_compile, strategy=None):
    """A compiled model with `metrics` and an iterator over `batch`, repeated."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = build_mlp(sizes)
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=metrics,
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


def timed_rounds(
    gradient_metrics,
    variants,
    sizes,
    batch_size,
    rounds,
    round_seconds,
    jit_compile,
    clock=time.perf_counter,
    log=print,
    strategy=None,
):
    """Times `variants` (the first two: `reference`, `control`) in paired rounds.

    Args:
        gradient_metrics: `variant -> [metric, ...]`, fresh objects per call.

    Returns:
        `(params, steps, times)`: the trainable parameters, the steps per
        round, and `{variant: [seconds per step, per round]}`.
    """
    strategy = strategy or tf.distribute.get_strategy()
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.random((batch_size, sizes[0]), "float32")),
        tf.constant(rng.integers(0, sizes[-1], (batch_size,)).astype("int32")),
    )
    keras.utils.set_random_seed(0)
    weights = build_mlp(sizes).get_weights()
    entries = {
        v: make_variant(gradient_metrics(v), sizes, batch, weights, jit_compile, strategy)
        for v in variants
    }
    for entry in entries.values():
        run_steps(*entry, 3)  # warm-up, outside the timing
    params = int(sum(np.prod(v.shape) for v in entries["reference"][0].trainable_variables))
    one = min(run_steps(*entries["reference"], 3) / 3 for _ in range(2))
    steps = max(1, int(round(round_seconds / one)))
    log(
        f"{params:,} parameters, jit_compile={jit_compile}, "
        f"{strategy.num_replicas_in_sync} replica(s): {one * 1e3:.2f} ms/step "
        f"(reference), {steps} steps/round, {rounds} rounds"
    )
    times = {v: [] for v in variants}
    for r in range(rounds):
        rotated = variants[r % len(variants) :] + variants[: r % len(variants)]
        gc.collect()
        gc.disable()
        try:
            for variant in rotated:
                times[variant].append(run_steps(*entries[variant], steps, clock) / steps)
        finally:
            gc.enable()
    return params, steps, times


def ratios(times):
    """Per variant: median step ms, ratio to `reference`, overhead beyond `control`."""
    reference = np.asarray(times["reference"])
    control = np.asarray(times["control"]) / reference
    results = {}
    for variant, seconds in times.items():
        ratio = np.asarray(seconds) / reference
        results[variant] = {
            "step_ms": float(np.median(seconds) * 1e3),
            "ratio": quartiles(ratio),
            "beyond_control": quartiles(ratio - control),
        }
    return results


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
