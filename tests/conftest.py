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

# The training-dynamics, report, skipping and statistics cases report their
# failed asserts as test modules do.
pytest.register_assert_rewrite("dynamics_cases", "report_cases", "skipping_cases", "stats_cases")

import keras_keepgrad as kg  # noqa: E402
from keras_keepgrad import _compat  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BACKEND = keras.backend.backend()

if BACKEND == "torch":
    import torch._dynamo  # noqa: E402

    # Dynamo compiles Keras's step anew for each model, and after
    # `recompile_limit` versions of its code (8) it runs the
    # step eagerly, with only a logged warning. `clear_session()`, after
    # each test, resets Dynamo; a "jit" test that compiles more models than
    # that fails rather than testing the eager step in their place.
    torch._dynamo.config.fail_on_recompile_limit_hit = True

# The contract's tests: the same functions run on TensorFlow, JAX and
# PyTorch (`test_backends.py` runs them under KERAS_BACKEND=jax and torch).
# A test of what only one backend has carries
# `@pytest.mark.backends("tensorflow", reason=...)` and is deselected on the
# others. The rest of `tests/` (subprocesses: tutorials, docs, benchmarks,
# Keras's own suite, tf.distribute; the package's layout) runs on TensorFlow
# only, and `jax_backend/` / `torch_backend/` on their own backend only.
CONTRACT = (
    "test_model.py",
    "test_capture.py",
    "test_metrics.py",
    "test_saving.py",
    "test_dynamics.py",
    "test_skipping.py",
    "test_stats.py",
    "callbacks",
    "test_benchmark_floors.py",
)
BACKENDS = ("tensorflow", "jax", "torch")
_BACKEND_DIRS = {"jax": "jax_backend", "torch": "torch_backend"}
collect_ignore = [d for b, d in _BACKEND_DIRS.items() if b != BACKEND]
if BACKEND != "tensorflow":
    collect_ignore += [
        name
        for name in os.listdir(os.path.dirname(os.path.abspath(__file__)))
        if (name.startswith("test_") and name.endswith(".py") or name == "keras_suite")
        and name not in CONTRACT
    ]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backends(*names, reason): the test runs on the named Keras backends only "
        "and is deselected (not skipped) on the others; `reason` says why",
    )
    config.addinivalue_line(
        "markers",
        "not_compiled_on_torch(reason): the test's `jit` case (its id has `jit`) is deselected on "
        "PyTorch (its other modes run there); `reason` names the compiled case "
        "that crosses the same graph breaks",
    )


def _runs_here(item):
    """Whether `item` runs on this backend (its `backends` and
    `not_compiled_on_torch` marks). A mark used wrongly, or a `release`
    test not marked `slow`, is a usage error."""
    if item.get_closest_marker("release") and not item.get_closest_marker("slow"):
        # So that `-m "not slow"`, which replaces addopts' `-m "not release"`,
        # leaves out the release tests too.
        raise pytest.UsageError(f"{item.nodeid}: a `release` test is `slow` too")
    marker = item.get_closest_marker("backends")
    if marker is not None:
        unknown = set(marker.args) - set(BACKENDS)
        if not marker.args or unknown or not marker.kwargs.get("reason"):
            raise pytest.UsageError(
                f"{item.nodeid}: `backends` takes backend names among {BACKENDS} and a "
                f"`reason`. Received: args={marker.args}, kwargs={marker.kwargs}"
            )
        if BACKEND not in marker.args:
            return False
    marker = item.get_closest_marker("not_compiled_on_torch")
    if marker is not None:
        if marker.args or not marker.kwargs.get("reason"):
            raise pytest.UsageError(
                f"{item.nodeid}: `not_compiled_on_torch` takes a `reason` alone. "
                f"Received: args={marker.args}, kwargs={marker.kwargs}"
            )
        callspec = getattr(item, "callspec", None)
        if BACKEND == "torch" and callspec is not None and "jit" in callspec.id.split("-"):
            return False
    return True


def compiled_on_torch_only(values, compiled, reason, ids=None):
    """`pytest.param`s of `values` for a parametrize, of which those not in
    `compiled` carry `not_compiled_on_torch(reason=reason)`; `ids(value)`
    names each (pytest names them without it)."""
    mark = pytest.mark.not_compiled_on_torch(reason=reason)
    return [
        pytest.param(
            value,
            id=None if ids is None else ids(value),
            marks=() if value in compiled else mark,
        )
        for value in values
    ]


# The longest tests, each a pytest run in a subprocess for minutes, in this
# order before all others: `.ci/run` deals the tests out one at a time
# (`--dist loadgroup`, after the `xdist_group`s), so these start early on
# both workers and the run does not end on one worker running one alone.
LONGEST_FIRST = (
    "tests/test_keras_suite.py::test_keras_suite_passes_on_keepgradmodel",
    "tests/test_backends.py::test_the_torch_suite_passes",
    "tests/test_backends.py::test_the_jax_suite_passes",
    "tests/test_keras_suite.py::test_keras_suite_jit_training_passes_on_torch",
)


def _rank(item):
    name = item.nodeid.split("[")[0]
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    selected, deselected = [], []
    for item in items:
        (selected if _runs_here(item) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = sorted(selected, key=_rank)  # stable: the others keep their order


def computed_once(tmp_path_factory, name, compute):
    """`compute()`, a JSON value, computed once in a test run however many
    test workers (`pytest -n`) ask for it: each worker has its own copy of
    a module-scoped fixture, so a fixture that runs a subprocess for a
    minute would run once per worker. The first computes it under a file
    lock in the run's shared temporary directory, the others read it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    import filelock

    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with filelock.FileLock(f"{path}.lock"):
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
    return value


def keras_histogram_tag(path):
    """The tag of Keras's own TensorBoard weight histogram of variable `path`.

    Keras 3.14 and later name it by the variable's path, earlier releases by
    its name alone (so two layers' kernels share a tag).
    """
    name = path if _compat.KERAS_VERSION >= (3, 14) else path.rsplit("/", 1)[-1]
    return f"{name}/histogram"


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
if BACKEND in ("jax", "torch"):
    # Keras's JAX and PyTorch trainers (and their keepers) run
    # `run_eagerly=True` and `jit_compile=False` alike, uncompiled; "jit"
    # runs the step under `jax.jit` or `torch.compile`.
    del MODES["graph"]


def asked_modes(modes, asked):
    """The `modes` a run tests: those named in `asked`, the value of
    KEEPGRAD_TEST_MODES (comma-separated), or all when it is unset or empty.
    The oldest tested set runs TensorFlow's default on a CPU, "graph", and
    the tests written for XLA as they are (.ci/oldest.sh)."""
    if not asked:
        return modes
    names = asked.split(",")
    if not set(names) <= set(modes):
        raise pytest.UsageError(
            f"KEEPGRAD_TEST_MODES names the modes to test, of {sorted(modes)} on {BACKEND}; "
            f"received {asked!r}"
        )
    return {name: modes[name] for name in names}


MODES = asked_modes(MODES, os.environ.get("KEEPGRAD_TEST_MODES"))


def modes(*names):
    """Those of the `MODES` `names` this backend has: a test that
    parametrizes over a few modes by name runs the ones that exist here."""
    return [name for name in names if name in MODES]


def no_warning_on_jax(category, match):
    """`pytest.warns(category, match=match)` for a warning of Keras's
    TensorFlow and PyTorch trainers that its JAX trainer does not give
    (no trainable weights; a None gradient, where `jax.grad` gives zeros)."""
    if BACKEND == "jax":
        return contextlib.nullcontext()
    return pytest.warns(category, match=match)


def without_numpy_array_warnings(caught):
    """The warnings of `caught` but NumPy 2's about torch's `__array__`, which
    Keras's PyTorch `convert_to_numpy` gives at every batch's logs (ignored
    in pyproject.toml, yet recorded where a test records every warning)."""
    return [w for w in caught if "__array__ implementation" not in str(w.message)]


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


# The ids of a test's cases with Keras's step and with `LateBuilt`'s own.
STEP_IDS = {False: "keras_step", True: "own_step"}


class LateBuilt(kg.KeepGradModel):
    """The one-weight model, subclassed without an `Input`: on TensorFlow
    it is built by its first batch, after `on_train_begin` (JAX and PyTorch
    build it before). `own_step` trains it with a `train_step` of its own
    (mse, `optimizer.apply`), written for the backend; it updates the
    compiled metrics after `apply`, or before it with `metrics_first` (a
    mistake)."""

    def __init__(self, own_step=False, metrics_first=False, **kwargs):
        super().__init__(**kwargs)
        self.own_step = own_step
        self.metrics_first = metrics_first
        self.dense = keras.layers.Dense(
            1,
            use_bias=False,
            kernel_initializer=keras.initializers.Constant(3.0),
            name="dense_0",
        )

    def call(self, x):
        return self.dense(x)

    def train_step(self, *args):
        if not self.own_step:
            return super().train_step(*args)
        backend = keras.backend.backend()
        if backend == "jax":
            return self._jax_step(*args)
        if backend == "torch":
            return self._torch_step(*args)
        return self._tf_step(*args)

    def _tf_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x)
            loss = tf.reduce_mean((y_pred - y) ** 2)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        return self._apply_and_measure(grads, variables, x, y, y_pred, loss)

    def _apply_and_measure(self, grads, variables, x, y, y_pred, loss):
        if self.metrics_first:
            self.compute_metrics(x, y, y_pred)
        self.optimizer.apply(grads, variables)
        return {**self.compute_metrics(x, y, y_pred), "loss": loss}

    def _jax_step(self, state, data):
        import jax
        import jax.numpy as jnp

        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data

        def loss_fn(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            return jnp.mean((y_pred - y) ** 2), y_pred

        (loss, y_pred), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        if self.metrics_first:
            metrics_vars = self._jax_metrics(metrics_vars, x, y, y_pred)[1]
        trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        logs, metrics_vars = self._jax_metrics(metrics_vars, x, y, y_pred)
        return {**logs, "loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    def _jax_metrics(self, metrics_vars, x, y, y_pred):
        # As Keras's JAX step: the metrics update in a stateless scope.
        mapping = list(zip(self.metrics_variables, metrics_vars))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            logs = self.compute_metrics(x, y, y_pred)
        new = [scope.get_current_value(v) for v in self.metrics_variables]
        return logs, [old if n is None else n for n, old in zip(new, metrics_vars)]

    def _torch_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        y_pred = self(x)
        loss = torch.mean((y_pred - y) ** 2)
        loss.backward()
        variables = self.trainable_weights
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            return self._apply_and_measure(grads, variables, x, y, y_pred, loss.detach())


@keras.saving.register_keras_serializable(package="keras_keepgrad_tests")
class UpdatesByHand(kg.KeepGradModel):
    """Halves w by hand, without an optimizer or `keep_step_gradients`,
    then updates the compiled metrics: a step that keeps nothing. Written
    for the backend (JAX's step is stateless)."""

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return self._jax_step(*args)
        (data,) = args
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        for variable in self.trainable_variables:
            # Not through NumPy: the step may be a graph.
            variable.assign(keras.ops.stop_gradient(variable.value) * 0.5)
        return self.compute_metrics(x, y, self(x))

    def _jax_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self.stateless_call(trainable, non_trainable, x)
        mapping = list(zip(self.metrics_variables, metrics_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            logs = self.compute_metrics(x, y, y_pred)
        metrics_values = [scope.get_current_value(v) for v in self.metrics_variables]
        trainable = [0.5 * value for value in trainable]
        return logs, (trainable, non_trainable, optimizer_values, metrics_values)


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
        self.grads.append(
            {
                p: keras.ops.convert_to_numpy(t)
                for p, t in self.model.get_gradients_by_path().items()
            }
        )
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


def mse_gradients(model, x, y, variables=None):
    """`(loss, variables, grads)`: mean((model(x) - y)^2) and its gradients
    for `variables` (the trainable ones by default), from a TensorFlow tape
    or PyTorch's autograd: a stateful step's (JAX's steps are stateless:
    `jax_mse_and_gradients`)."""
    variables = model.trainable_variables if variables is None else variables
    if keras.backend.backend() == "torch":
        import torch

        # `train_on_batch` hands the step NumPy targets.
        loss = torch.mean((model(x) - keras.ops.convert_to_tensor(y)) ** 2)
        grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
        return loss.detach(), variables, list(grads)
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return loss, variables, tape.gradient(loss, variables)


def jax_mse_and_gradients(model, trainable, non_trainable, x, y):
    """`(loss, grads)`: mean((model(x) - y)^2) and its gradients for the
    `trainable` values, through `stateless_call`, as a JAX step takes them."""
    import jax

    def loss_of(trainable):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        return keras.ops.mean((y_pred - y) ** 2)

    return jax.value_and_grad(loss_of)(trainable)


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


def run_script(args, backend, cwd, timeout=600):
    """Runs `python args...` under `backend` in `cwd`; fails the test if it
    exits with an error. Returns its stdout."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=python_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (backend, result.stdout[-2000:] + result.stderr[-4000:])
    return result.stdout


_TENSORFLOW_OUTPUT = {}


def tensorflow_script_output(args, tmp_path_factory):
    """`run_script(args, "tensorflow", .../tf)`'s output, run once per
    session: the tutorials' own test and the comparison of their numbers
    across backends share one run. Returns `(stdout, cwd)`."""
    key = tuple(args)
    if key not in _TENSORFLOW_OUTPUT:
        cwd = tmp_path_factory.mktemp("script") / "tf"
        cwd.mkdir()
        _TENSORFLOW_OUTPUT[key] = run_script(args, "tensorflow", cwd), cwd
    return _TENSORFLOW_OUTPUT[key]


def run_benchmark(tmp_path, *args, out="result.json"):
    """Runs `benchmarks/run.py` with `args` and `--out`, from `tmp_path`.

    The script finds this checkout's package itself. Returns the finished
    process and the JSON it wrote; fails the test if it exited with an error.
    """
    path = tmp_path / out
    process = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "run.py"), *args, "--out", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(tmp_path),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return process, json.loads(path.read_text())


def _load_tutorial_pages():
    spec = importlib.util.spec_from_file_location(
        "tutorial_pages", os.path.join(REPO, "docs", "tutorial_pages.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# `docs/tutorial_pages.py`: the tutorials' pages and their recorded outputs.
pages = _load_tutorial_pages()


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
