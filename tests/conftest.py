import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_keepgrad as kg  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `jax_backend/` runs under KERAS_BACKEND=jax, `torch_backend/` under
# KERAS_BACKEND=torch, each with `any_backend/` (`test_backends.py` starts
# them); the TensorFlow run collects none of the three.
_BACKEND_DIRS = {"jax": "jax_backend", "torch": "torch_backend"}
collect_ignore = [d for b, d in _BACKEND_DIRS.items() if b != keras.backend.backend()]
if keras.backend.backend() not in _BACKEND_DIRS:
    collect_ignore.append("any_backend")

# The one-weight model of the tests: a bias-free Dense(1) with w = 3,
# x = [[1], [2]], y = 0, mse. loss = mean((w*x)^2) -> d/dw = w*(1+4) = 5w = 15,
# and with SGD(0.1) the new weight is 3 - 0.1*15 = 1.5.
X = np.array([[1.0], [2.0]], dtype="float32")
Y = np.zeros((2, 1), dtype="float32")
W0 = 3.0

MODES = {
    "eager": dict(run_eagerly=True),
    "graph": dict(jit_compile=False),
    "jit": dict(jit_compile=True),
}
# On PyTorch "eager" and "graph" both run eagerly, "jit" with `torch.compile`.


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(params=list(MODES))
def mode(request):
    return MODES[request.param]


def dense_0(dtype=None, name="dense_0", w=W0):
    return keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(w),
        name=name,
        dtype=dtype,
    )


def one_weight(cls=kg.KeepGradModel, dtype=None, layer="dense_0", **options):
    """The one-weight model, uncompiled; `options` go to `cls`."""
    inputs = keras.Input((1,))
    return cls(inputs, dense_0(dtype=dtype, name=layer)(inputs), **options)


def kernel(model):
    """The kept gradient of the one-weight model's kernel."""
    return model.gradients["dense_0"]["kernel"]


class Recorder(keras.callbacks.Callback):
    """Records the kept gradients after each training batch.

    `seen`: the one-weight kernel's gradient as a float (None in a model
    without one); `grads`: every gradient by path; `batches`: the
    `(epoch, batch)` of each; `at_begin`: the kernel's at `on_train_begin`.
    """

    def __init__(self):
        super().__init__()
        self.seen, self.grads, self.batches = [], [], []
        self.at_begin = None
        self._epoch = None

    def _kernel(self):
        layer = self.model.gradients.get("dense_0")
        return None if layer is None or "kernel" not in layer else layer["kernel"]

    def on_train_begin(self, logs=None):
        # Before the first step of a new training function nothing is kept.
        try:
            self.at_begin = self._kernel()
        except RuntimeError as error:
            self.at_begin = error

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        found = self._kernel()
        self.seen.append(None if found is None else float(found[0, 0]))
        self.grads.append({p: np.asarray(t) for p, t in self.model.get_gradients_by_path().items()})
        self.batches.append((self._epoch, batch))


def fit_once(model, optimizer=None, batches=1, **compile_kwargs):
    """Compiles `model` (mse, SGD(0.1) by default) and fits `batches`
    identical batches of `X`, `Y`; returns the `History`."""
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model.fit(
        np.tile(X, (batches, 1)),
        np.tile(Y, (batches, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
    )


def fit_batches(model, n, **fit_kwargs):
    """Fits `n` identical batches of `X`, `Y` in order; returns their `Recorder`."""
    rec = Recorder()
    model.fit(
        np.tile(X, (n, 1)),
        np.tile(Y, (n, 1)),
        batch_size=2,
        shuffle=False,
        verbose=0,
        callbacks=[rec, *fit_kwargs.pop("callbacks", [])],
        **fit_kwargs,
    )
    return rec


def python_env(**extra):
    """The environment of a subprocess that imports this checkout's package."""
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", **extra)


def run_benchmark(tmp_path, script, *args, out="result.json"):
    """Runs `benchmarks/<script>` with `args` and `--out`, from `tmp_path`.

    The script finds this checkout's package itself. Returns the finished
    process and the JSON it wrote; fails the test if it exited with an error.
    """
    path = tmp_path / out
    process = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", script), *args, "--out", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return process, json.loads(path.read_text())


def load_benchmark(name):
    """`benchmarks/<name>.py` as a module; benchmarks/ goes on `sys.path`."""
    here = os.path.join(REPO, "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    spec = importlib.util.spec_from_file_location(name, os.path.join(here, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_ports(n):
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
