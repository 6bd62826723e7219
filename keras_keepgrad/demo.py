"""Demo: watch gradients vanish in a deep sigmoid MLP, and not in ReLU+BN.

Run `python -m keras_keepgrad.demo --logdir runs/demo`. It trains two small
models on synthetic data with `KeepGradModel` (seconds on a laptop CPU):
gradient metrics in the progress bar, `GradientTensorBoard` panels under
`--logdir`, a `GradientMonitor` watching for vanishing layers, and at the end
`GradientReport`'s per-layer gradient health table (also as
`<kind>_report.html` and `<kind>_report.png` under `--logdir`).
"""

import argparse
import csv
import math
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

VANISHING = kg.callbacks.VANISHING_THRESHOLD


def synthetic_data(n=2048, dims=16, seed=0):
    """Two noisy classes separated along a random direction."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dims)).astype("float32")
    direction = rng.normal(size=(dims,)).astype("float32")
    y = (x @ direction + 0.3 * rng.normal(size=n) > 0).astype("float32")[:, None]
    return x, y


def numpy_initial_weights(model, seed):
    """Redraws every `kernel` as Keras's default Glorot-uniform, from NumPy.

    Keras's initializers draw from the backend's own random generator, so
    the same seed gives other weights on TensorFlow and on JAX; NumPy's
    generator gives the same ones on both. Biases and BatchNormalization's
    variables start at constants already.
    """
    rng = np.random.default_rng(seed)
    for variable in model.trainable_variables:
        if variable.path.endswith("kernel"):
            fan_in, fan_out = int(np.prod(variable.shape[:-1])), int(variable.shape[-1])
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            variable.assign(rng.uniform(-limit, limit, variable.shape).astype(variable.dtype))


def build_model(kind, depth=8, width=32, dims=16):
    """A deep MLP: "sigmoid" (gradients vanish) or "relu_bn" (healthy)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((dims,), name="x")
    h = inputs
    for i in range(depth):
        if kind == "sigmoid":
            h = keras.layers.Dense(width, activation="sigmoid", name=f"dense_{i}")(h)
        else:
            h = keras.layers.Dense(width, name=f"dense_{i}")(h)
            h = keras.layers.BatchNormalization(name=f"bn_{i}")(h)
            h = keras.layers.Activation("relu", name=f"relu_{i}")(h)
    outputs = keras.layers.Dense(1, activation="sigmoid", name="out")(h)
    model = kg.KeepGradModel(inputs, outputs, name=f"mlp_{kind}")
    # The same initial weights, and batches in order, on every backend.
    numpy_initial_weights(model, seed=1)
    return model


class LayerNorms(keras.callbacks.Callback):
    """Collects each layer's kept-gradient L2 norm after every batch."""

    def __init__(self):
        super().__init__()
        self.norms = {}  # layer -> list of norms, one per step

    def on_train_batch_end(self, batch, logs=None):
        # `model.gradients` nests the gradients by layer (the demo's layers
        # hold no sub-layers); NumPy reads every backend's tensors.
        for layer, grads in self.model.gradients.items():
            squares = sum(
                float(np.sum(np.square(keras.ops.convert_to_numpy(g)))) for g in grads.values()
            )
            self.norms.setdefault(layer, []).append(math.sqrt(squares))


def run(kind, x, y, epochs, logdir, verbose):
    """Trains one model; returns its history, norms, CSV path, monitor and report."""
    model = build_model(kind)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="binary_crossentropy",
        metrics=[kg.metrics.GradientNorm(), kg.metrics.VanishingGradients(threshold=VANISHING)],
    )
    norms = LayerNorms()
    report = kg.callbacks.GradientReport(
        print_table=False,  # shown after the monitor's summary, below
        png=os.path.join(logdir, f"{kind}_report.png"),
        html=os.path.join(logdir, f"{kind}_report.html"),
    )
    monitor = kg.callbacks.GradientMonitor(
        action="warn", vanishing_threshold=VANISHING, vanishing_steps=5
    )
    board = kg.callbacks.GradientTensorBoard(
        log_dir=os.path.join(logdir, kind), update_freq=4, histogram_freq=1
    )
    with warnings.catch_warnings():
        # The monitor's findings are summarized below, not warned one by one.
        warnings.filterwarnings("ignore", message="GradientMonitor", category=UserWarning)
        history = model.fit(
            x,
            y,
            batch_size=128,
            epochs=epochs,
            shuffle=False,
            verbose=verbose,
            callbacks=[norms, monitor, board, report],
        )
    path = os.path.join(logdir, f"{kind}_grad_norms.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step"] + list(norms.norms))
        for step, row in enumerate(zip(*norms.norms.values())):
            writer.writerow([step + 1] + [f"{v:.6e}" for v in row])
    return history.history, norms.norms, path, monitor, report


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_keepgrad.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--logdir", default="runs/demo", help="where to write the logs (default: runs/demo)"
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs per model (default: 3)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be a positive int. Received: --epochs={args.epochs}")
    try:
        os.makedirs(args.logdir, exist_ok=True)
        if not os.access(args.logdir, os.W_OK):
            raise PermissionError(f"cannot write to {args.logdir!r}")
    except OSError as e:
        print(f"error: --logdir {args.logdir!r} is not writable: {e}", file=sys.stderr)
        return 2

    x, y = synthetic_data()
    print(f"Keras {keras.__version__} on the {keras.backend.backend()} backend")
    start = time.time()
    for kind in ("sigmoid", "relu_bn"):
        print(f"\n== {kind}: 8 hidden layers, {len(x)} synthetic samples ==")
        history, norms, path, monitor, report = run(
            kind, x, y, args.epochs, args.logdir, verbose=0 if args.quiet else 2
        )
        print(
            f"final loss {history['loss'][-1]:.4f}, grad_norm {history['grad_norm'][-1]:.3e}, "
            f"vanishing layers {history['grad_vanishing'][-1]:.0%}; "
            f"per-step norms in {path}"
        )
        for event in monitor.events:
            print(f"GradientMonitor: {event['message']}")
        print(f"GradientMonitor summary:\n{monitor.summary()}")
        print(f"Health report (also {kind}_report.html and .png in {args.logdir}):")
        report.show()
    print(
        f"\nDone in {time.time() - start:.1f} s. Gradient panels: "
        f"tensorboard --logdir {args.logdir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
