"""What `GradientTensorBoard` adds to `fit`, against Keras's own TensorBoard.

One `KeepGradModel` (a ~1M-parameter MLP: 512 -> 1024 -> 512 -> 10, Adam,
batch 128) is trained by every variant, so the variants differ only in the
callback. Each round runs one `fit` per variant (`epochs` epochs of
`steps_per_epoch` steps over a repeated in-memory batch, `verbose=0`), in an
order rotated by one each round, so that slow drifts of a shared machine hit
every variant alike. Every `fit` gets a fresh callback and a fresh log
directory, as a user's `fit` would. Reported per variant: the median over
rounds of its `fit` time divided by that round's `none` time (and the
interquartile range), and the median of `ratio - ratio(control)`, where
`control` is a second run without callbacks (its ratio is 1 up to noise).

Variants:

- `none`, `control`: no callback.
- `keras_tb`: `keras.callbacks.TensorBoard(update_freq="epoch")`.
- `grad_tb`: `GradientTensorBoard(update_freq="epoch")` (norm scalars and
  the heatmap at each epoch end; no histograms).
- `keras_tb_1`: `keras.callbacks.TensorBoard(update_freq=1)`.
- `grad_tb_1`: `GradientTensorBoard(update_freq=1)`: gradient norms every
  batch.
- `monitor`: `GradientMonitor()` (non-finite check every batch).

Also printed: the median per-round ratio `grad_tb / keras_tb` (the
target: at most 1.03) and what `update_freq=1` adds per training step.
Tracing and the first writer are excluded by one warm-up `fit` per variant.

Usage:

```shell
python benchmarks/tensorboard_overhead.py           # 15 rounds, ~10 min on 2 busy cores
python benchmarks/tensorboard_overhead.py --quick   # 5 short rounds, ~2 min
```
"""

import argparse
import gc
import os
import platform
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

VARIANTS = ("none", "control", "keras_tb", "grad_tb", "keras_tb_1", "grad_tb_1", "monitor")
TARGET = 1.03  # grad_tb / keras_tb, median over rounds

MODES = {
    "full": dict(rounds=15, steps_per_epoch=100, epochs=2),
    "quick": dict(rounds=5, steps_per_epoch=40, epochs=2),
}


def build_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    h = keras.layers.Dense(1024, activation="relu", name="dense_0")(inputs)
    h = keras.layers.Dense(512, activation="relu", name="dense_1")(h)
    outputs = keras.layers.Dense(10, name="logits")(h)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_callback(variant, log_dir):
    if variant in ("none", "control"):
        return None
    if variant == "keras_tb":
        return keras.callbacks.TensorBoard(log_dir, update_freq="epoch")
    if variant == "grad_tb":
        return kg.callbacks.GradientTensorBoard(log_dir, update_freq="epoch")
    if variant == "keras_tb_1":
        return keras.callbacks.TensorBoard(log_dir, update_freq=1)
    if variant == "grad_tb_1":
        return kg.callbacks.GradientTensorBoard(log_dir, update_freq=1)
    if variant == "monitor":
        return kg.callbacks.GradientMonitor()
    raise ValueError(f"Unknown variant: {variant!r}")


class _Clock(keras.callbacks.Callback):
    """Wall and process-CPU time from `on_train_begin` to `on_train_end`.

    Put first in the callback list (`start`) and last (`stop`): the interval
    holds every batch and every callback's begin and end work, but not
    `fit`'s own set-up and tear-down (on a shared machine, releasing the
    `tf.data` iterator alone varies by a second).
    """

    def __init__(self, state, stop):
        super().__init__()
        self.state = state
        self.stop = stop

    def on_train_begin(self, logs=None):
        if not self.stop:
            self.state["begin"] = (time.perf_counter(), time.process_time())

    def on_train_end(self, logs=None):
        if self.stop:
            self.state["end"] = (time.perf_counter(), time.process_time())


_HOOKS = (
    "set_model",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
)


def instrument(callback, state):
    """Adds the wall time spent in `callback`'s hooks to `state["hooks"]`.

    Only for callbacks that override `on_train_batch_end` (all variants
    here): Keras decides on asynchronous batch callbacks by whether that
    method is the default one.
    """
    state["hooks"] = 0.0
    for name in _HOOKS:
        method = getattr(callback, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                state["hooks"] += time.perf_counter() - start

        setattr(callback, name, timed)


def time_fit(model, dataset, variant, log_dir, mode):
    """Wall seconds of `fit` and of training, CPU seconds, hook seconds."""
    callback = make_callback(variant, log_dir)
    state = {"hooks": 0.0}
    if callback is not None:
        instrument(callback, state)
    callbacks = [_Clock(state, stop=False)]
    callbacks += [callback] if callback else []
    callbacks += [_Clock(state, stop=True)]
    start = time.perf_counter()
    model.fit(
        dataset,
        steps_per_epoch=mode["steps_per_epoch"],
        epochs=mode["epochs"],
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    fit = time.perf_counter() - start
    return {
        "fit": fit,
        "train": state["end"][0] - state["begin"][0],
        "cpu": state["end"][1] - state["begin"][1],
        "hooks": state["hooks"],
    }


def check_written(log_dir):
    """The gradient variant really wrote its norms (not a silent no-op)."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(os.path.join(log_dir, "train"))
    acc.Reload()
    tags = acc.Tags()["tensors"]
    assert "gradients/global_norm" in tags, tags


def summary(values):
    q25, median, q75 = np.percentile(np.asarray(values, dtype="float64"), [25, 50, 75])
    return median, q25, q75


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 short rounds")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    args = parser.parse_args(argv)
    mode = dict(MODES["quick" if args.quick else "full"])
    if args.rounds:
        mode["rounds"] = args.rounds

    model = build_model()
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rng = np.random.default_rng(0)
    batch = (
        tf.constant(rng.random((128, 512), dtype="float32")),
        tf.constant(rng.integers(0, 10, (128,)).astype("int32")),
    )
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    root = tempfile.mkdtemp(prefix="tb_overhead_")
    steps = mode["steps_per_epoch"] * mode["epochs"]
    cpu = platform.processor() or platform.machine()
    print(
        f"{params:,} parameters; {mode['rounds']} rounds of {mode['epochs']} epochs x "
        f"{mode['steps_per_epoch']} steps per variant; {cpu}, "
        f"{os.cpu_count()} CPUs, TF {tf.__version__}, Keras {keras.__version__}",
        flush=True,
    )
    try:
        for variant in VARIANTS:  # warm-up: tracing, first writers
            log_dir = os.path.join(root, "warmup", variant)
            time_fit(model, dataset, variant, log_dir, mode)
            if variant.startswith("grad_tb"):
                check_written(log_dir)
        times = {v: [] for v in VARIANTS}
        order = list(VARIANTS)
        for r in range(mode["rounds"]):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            gc.collect()
            gc.disable()
            try:
                for variant in rotated:
                    log_dir = os.path.join(root, f"round{r}", variant)
                    times[variant].append(time_fit(model, dataset, variant, log_dir, mode))
            finally:
                gc.enable()
            shutil.rmtree(os.path.join(root, f"round{r}"), ignore_errors=True)
            print(
                f"  round {r + 1}/{mode['rounds']}: none {times['none'][-1]['train']:.2f}s",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(times, steps, mode["steps_per_epoch"])


def report(times, steps, steps_per_epoch):
    def series(variant, measure):
        return np.asarray([t[measure] for t in times[variant]])

    print()
    print(
        "Ratios are per round against `none`, median [IQR]; `train` is wall time "
        "from on_train_begin to on_train_end, `cpu` is process CPU time over the "
        "same span, `fit` is the whole `model.fit` call."
    )
    print()
    print(
        "| variant | train ms/step | train ratio | beyond control | cpu ratio | fit ratio "
        "| ms in its hooks per fit |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        cells = []
        for measure in ("train", "cpu", "fit"):
            ratio = series(variant, measure) / series("none", measure)
            m, q25, q75 = summary(ratio)
            cells.append(f"{m:.3f} [{q25:.3f}, {q75:.3f}]")
            if measure == "train":
                control = series("control", "train") / series("none", "train")
                cells.append(f"{summary(ratio - control)[0]:+.3f}")
        step_ms = np.median(series(variant, "train")) / steps * 1e3
        cells.append(f"{np.median(series(variant, 'hooks')) * 1e3:.1f}")
        print(f"| {variant} | {step_ms:.2f} | " + " | ".join(cells) + " |")
    print()
    step_ms = np.median(series("none", "train")) / steps * 1e3
    for measure in ("train", "cpu", "fit"):
        vs_keras = summary(series("grad_tb", measure) / series("keras_tb", measure))
        print(
            f"GradientTensorBoard(update_freq='epoch') / keras TensorBoard ({measure}): "
            f"median {vs_keras[0]:.4f} [IQR {vs_keras[1]:.4f}, {vs_keras[2]:.4f}]"
            + (
                f" (target <= {TARGET}: {'met' if vs_keras[0] <= TARGET else 'NOT met'})"
                if measure == "train"
                else ""
            )
        )
    hooks = summary((series("grad_tb", "hooks") - series("keras_tb", "hooks")) * 1e3)
    epochs = steps // steps_per_epoch
    epoch_ms = step_ms * steps_per_epoch
    print(
        f"GradientTensorBoard(update_freq='epoch') spends {hooks[0]:.1f} ms more in its "
        f"hooks per fit than keras TensorBoard [IQR {hooks[1]:.1f}, {hooks[2]:.1f}]: "
        f"{hooks[0] / epochs:.1f} ms per epoch, {hooks[0] / epochs / epoch_ms:.2%} of a "
        f"{steps_per_epoch}-step epoch ({epoch_ms:.0f} ms)"
    )
    per_step = summary((series("grad_tb_1", "train") - series("keras_tb_1", "train")) / steps * 1e3)
    print(
        f"update_freq=1 adds {per_step[0]:.2f} ms per step beyond keras "
        f"TensorBoard(update_freq=1) [IQR {per_step[1]:.2f}, {per_step[2]:.2f}], "
        f"{per_step[0] / step_ms:.1%} of a {step_ms:.2f} ms step"
    )
    per_step_hooks = summary(
        (series("grad_tb_1", "hooks") - series("keras_tb_1", "hooks")) / steps * 1e3
    )
    print(
        f"update_freq=1: {per_step_hooks[0]:.2f} ms more per step in its hooks than "
        f"keras TensorBoard(update_freq=1) [IQR {per_step_hooks[1]:.2f}, "
        f"{per_step_hooks[2]:.2f}], {per_step_hooks[0] / step_ms:.1%} of a step"
    )
    monitor = summary((series("monitor", "train") - series("none", "train")) / steps * 1e3)
    print(
        f"GradientMonitor() adds {monitor[0]:.2f} ms per step "
        f"[IQR {monitor[1]:.2f}, {monitor[2]:.2f}], {monitor[0] / step_ms:.1%}; "
        f"{np.median(series('monitor', 'hooks')) / steps * 1e3:.2f} ms per step in its hooks"
    )


if __name__ == "__main__":
    main()
