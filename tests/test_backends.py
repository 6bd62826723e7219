"""The suite's JAX and PyTorch runs, started from the TensorFlow run of the
suite, and the tutorials and demo on every backend.

The contract's test modules (`conftest.CONTRACT`: what is kept, metrics,
callbacks, saving, your own `train_step`, dynamics, skipping, statistics,
the report) are the same test functions on every backend: each run collects
them, and deselects the tests marked `@pytest.mark.backends(...)` for other
backends. `jax_backend/` and `torch_backend/` add what is each backend's own
(the hand model's exact gradients against `jax.grad` /
`torch.autograd.grad`, distribution on JAX, the held `.grad` tensors on
PyTorch). One pytest process can only have one Keras backend, so each runs
in a subprocess: `KERAS_BACKEND=jax` with two host CPU devices (for
`DataParallel` and `ModelParallel`), and `KERAS_BACKEND=torch`.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import conftest
import pytest
from conftest import CONTRACT
from conftest import REPO
from conftest import pages
from conftest import python_env
from conftest import run_script
from conftest import tensorflow_script_output

# Each backend's run in parts of about equal length, so that the test
# workers (`pytest -n`) share them instead of one worker running one long
# subprocess at the end.
PARTS = (
    ("test_model.py", "test_capture.py", "test_saving.py"),
    ("test_metrics.py", "test_dynamics.py", "test_benchmark_floors.py", "{backend}_backend"),
    ("test_skipping.py", "test_stats.py", "callbacks"),
)


def test_the_parts_cover_the_contract():
    names = [name for part in PARTS for name in part]
    assert sorted(names) == sorted(CONTRACT + ("{backend}_backend",))


def test_the_longest_tests_come_first_and_exist():
    functions = {}
    for name in conftest.LONGEST_FIRST:
        path, function = name.split("::")
        if path not in functions:
            with open(os.path.join(REPO, path)) as f:
                tree = ast.parse(f.read())
            functions[path] = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert function in functions[path], name
    ranks = [conftest._rank(_Item(None, nodeid=name + "[0]")) for name in conftest.LONGEST_FIRST]
    assert ranks == list(range(len(conftest.LONGEST_FIRST)))
    assert conftest._rank(_Item(None, nodeid="tests/test_model.py::t")) == len(ranks)


def test_a_run_tests_the_modes_it_asks_for():
    modes = {"eager": 1, "graph": 2, "jit": 3}
    assert conftest.asked_modes(modes, None) is modes
    assert conftest.asked_modes(modes, "") is modes
    assert conftest.asked_modes(modes, "graph") == {"graph": 2}
    assert conftest.asked_modes(modes, "jit,eager") == {"jit": 3, "eager": 1}
    with pytest.raises(
        pytest.UsageError, match="of \\['eager', 'graph', 'jit'\\] .*received 'graph,xla'"
    ):
        conftest.asked_modes(modes, "graph,xla")


class _Item:
    """What `conftest._runs_here` reads of a collected test."""

    def __init__(self, callspec_id, *marks, nodeid=None):
        self.nodeid = nodeid or f"t[{callspec_id}]"
        self.callspec = type("CallSpec", (), {"id": callspec_id})
        self.marks = {mark.name: mark for mark in marks}

    def get_closest_marker(self, name):
        return self.marks.get(name)


@pytest.mark.parametrize("backend", conftest.BACKENDS)
def test_a_case_not_compiled_on_torch_runs_but_its_jit_case_there(backend, monkeypatch):
    monkeypatch.setattr(conftest, "BACKEND", backend)
    marked = pytest.mark.not_compiled_on_torch(reason="another case").mark
    found = {
        callspec_id: conftest._runs_here(_Item(callspec_id, marked))
        for callspec_id in ("eager", "jit", "jit-sgd", "eager-jitter", "True")
    }
    runs = backend != "torch"
    assert found == {
        "eager": True,
        "jit": runs,
        "jit-sgd": runs,
        "eager-jitter": True,
        "True": True,
    }
    assert conftest._runs_here(_Item("jit")) is True
    # On the backends it names only, and its jit case not on PyTorch.
    only_torch = pytest.mark.backends("torch", reason="PyTorch's own").mark
    assert conftest._runs_here(_Item("eager", only_torch, marked)) is (backend == "torch")
    assert conftest._runs_here(_Item("jit", only_torch, marked)) is False
    with pytest.raises(pytest.UsageError, match="takes a `reason` alone"):
        conftest._runs_here(_Item("jit", pytest.mark.not_compiled_on_torch().mark))


def test_a_release_test_is_slow_too():
    release, slow = pytest.mark.release.mark, pytest.mark.slow.mark
    assert conftest._runs_here(_Item("eager", release, slow)) is True
    with pytest.raises(pytest.UsageError, match=r"t\[eager\]: a `release` test is `slow` too"):
        conftest._runs_here(_Item("eager", release))


def _run_suite(backend, part, **env):
    paths = [f"tests/{name.format(backend=backend)}" for name in PARTS[part]]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
        cwd=REPO,
        env=python_env(KERAS_BACKEND=backend, **env),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Every case ran: none skipped (on JAX, for want of the two devices), and
    # the backend-only tests were deselected, not skipped.
    assert " passed" in result.stdout and "skipped" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("part", range(len(PARTS)))
def test_the_jax_suite_passes(part):
    _run_suite("jax", part, XLA_FLAGS="--xla_force_host_platform_device_count=2")


def _require_torch():
    # In the `test` extra: a missing PyTorch is a broken test install, and
    # its part of the suite fails rather than being skipped unseen.
    if importlib.util.find_spec("torch") is None:
        pytest.fail(
            "PyTorch is not installed, so the PyTorch suite cannot run: "
            'install the test extra, `pip install -e ".[cpu,test]"`'
        )


@pytest.mark.slow
@pytest.mark.parametrize("part", range(len(PARTS)))
def test_the_torch_suite_passes(part):
    _require_torch()
    _run_suite("torch", part)


# The tutorials that make sense on JAX and PyTorch (not `distributed.py`:
# tf.distribute) and the demo. Their numbers come from NumPy-drawn weights
# and batches in order, so every backend prints the same ones.
SCRIPTS = {
    name: [os.path.join(REPO, "tutorials", f"{name}.py"), "--fast"]
    for name in (
        "quickstart",
        "mixed_precision",
        "saving",
        "custom_metric_and_callback",
        "diagnosing_gradients",
        "surviving_a_loss_spike",
    )
}
SCRIPTS["demo"] = ["-m", "keras_keepgrad.demo", "--epochs", "1", "--quiet", "--logdir", "demo"]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# What differs between runs anyway: timings and the run's own paths.
_TIMING = re.compile(r"\d+(?:\.\d+)?(?:ms|us|s)(?:/step)?\b|Done in \S+ s")


def _lines(stdout, cwd=None):
    # Keras's progress lines as the tutorials' recorded outputs have them.
    stdout = pages._TIMING.sub(r"\1\2", stdout)
    if cwd is not None:
        stdout = stdout.replace(str(cwd), "<dir>")
    return _TIMING.sub("<time>", stdout).splitlines()


def _tensorflow_lines(script, tmp_path_factory):
    """The script's output on TensorFlow. A tutorial's is its recorded
    output, which `test_tutorials.py` checks against a run on TensorFlow."""
    if script in pages.tutorial_names():
        return _lines("".join(out for _, out in pages.read_record(script)))
    return _lines(*tensorflow_script_output(SCRIPTS[script], tmp_path_factory))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize(
    "script",
    # CI runs the demo, the README's first command; the tutorials on JAX
    # and PyTorch run before a release (`-m release`).
    [
        script if script == "demo" else pytest.param(script, marks=pytest.mark.release)
        for script in SCRIPTS
    ],
)
def test_same_numbers_as_on_tensorflow(script, backend, tmp_path, tmp_path_factory):
    if backend == "torch":
        _require_torch()
    on_tf = _tensorflow_lines(script, tmp_path_factory)
    cwd = tmp_path / backend
    cwd.mkdir()
    other = _lines(run_script(SCRIPTS[script], backend, cwd), cwd)
    assert len(on_tf) == len(other) and on_tf, (on_tf, other)
    compared = 0
    for tf_line, line in zip(on_tf, other):
        tf_line, line = tf_line.replace("/tf", "/<b>"), line.replace(f"/{backend}", "/<b>")
        # The demo says which backend it ran on (and pads its table to the
        # name's length).
        tf_line = " ".join(tf_line.replace("tensorflow", "<b>").split())
        line = " ".join(line.replace(backend, "<b>").split())
        assert _NUMBER.sub("#", tf_line) == _NUMBER.sub("#", line), (tf_line, line)
        for a, b in zip(_NUMBER.findall(tf_line), _NUMBER.findall(line)):
            # Printed to 4 or 5 digits; full float reprs agree to float32
            # rounding (XLA, TensorFlow and PyTorch kernels sum in other
            # orders).
            assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-6), (tf_line, line)
            compared += 1
    assert compared > 0
