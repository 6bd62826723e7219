"""The package's layout: no import cycles, backend code only under `backend/`,
private upstream names only in `_compat.py`, no TensorFlow off its backend."""

import ast
import json
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest
from conftest import REPO
from conftest import python_env

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_keepgrad"


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path, modules):
    """The package modules `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from keras_keepgrad import x` imports module `x` if there is
            # one (the package itself is imported already), else the package.
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def _cycle(graph):
    """One import cycle of `graph` as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A package's `__init__` is imported by its submodules' imports:
        # count only what the modules themselves import.
        graph[name] = {m for m in _imports(path, modules) if m != name}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


# The package's layers, bottom up: a module imports from its own layer and
# those below, never back up (the metrics never import the callbacks, the
# backends never the metrics).
LAYERS = [
    ["_paths", "_compat", "_ops", "_checks", "_files", "_torch_compile", "_spikes"],
    ["_squares", "_stats", "_capture", "_saving", "_replicas"],
    ["backend", "_evidence", "_skipping"],
    ["metrics"],
    ["model", "wrapping"],
    ["callbacks"],
    ["demo"],
]


def _layer(module):
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS) - 1  # the package's `__init__`: with `demo`, on top
    for i, layer in enumerate(LAYERS):
        if parts[1] in layer:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def test_no_import_runs_back_up_the_layers():
    modules = _modules()
    upward = [
        f"{name} -> {target}"
        for name, path in modules.items()
        for target in _imports(path, modules)
        if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_model_has_no_backend_branch():
    source = (PACKAGE / "model.py").read_text()
    assert not re.search(r"\bBACKEND\b|backend\(\)", source)
    assert "import tensorflow" not in source and "import torch" not in source
    assert "import jax" not in source


def test_only_backend_init_picks_the_backend_among_the_core_modules():
    for name in ("model.py", "wrapping.py", "backend/base.py"):
        source = (PACKAGE / name).read_text()
        assert not re.search(r"\bBACKEND\b|backend\(\)", source), name


def test_private_upstream_imports_only_in_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith(("keras.src", "tensorflow.python", "torch._")):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offenders == []


def test_private_upstream_attributes_only_in_compat():
    pattern = re.compile(
        r"\._distribute_strategy\b|\._trainable_variables\b|\._version\b"
        r"|\._get_state_sharding_spec\b|\._compile_config\b|\._tracker\b"
        r"|\._inputs_struct\b|\._outputs_struct\b"
    )
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        with open(path, "rb") as f:
            for token in tokenize.tokenize(f.readline):
                # Code only: docstrings and comments may name them.
                if token.type in (tokenize.STRING, tokenize.COMMENT):
                    continue
                if pattern.search(token.line) and token.type == tokenize.NAME:
                    if pattern.search("." + token.string):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{token.start[0]}")
    assert offenders == []


def test_core_modules_stay_small():
    # `model.py` and `callbacks/tensorboard.py` are longer: most of each is
    # the docstrings of what users call.
    core = ["wrapping.py", "_capture.py", "_checks.py", "_compat.py", "_squares.py", "_stats.py"]
    for package in ("backend", "metrics", "callbacks"):
        core += [str(p.relative_to(PACKAGE)) for p in (PACKAGE / package).rglob("*.py")]
    core.remove("callbacks/tensorboard.py")
    sizes = {name: len((PACKAGE / name).read_text().splitlines()) for name in core}
    assert {name: n for name, n in sizes.items() if n > 460} == {}


# Imports the package, trains with the gradient metrics (the norm and the
# training-dynamics ones) and `GradientMonitor`, and says whether TensorFlow
# was imported. Plain `import keras` does not import it on JAX or PyTorch
# (checked first), so whatever imports it later is this package.
_WITHOUT_TENSORFLOW = """
import json
import sys

import keras
import numpy as np

after_keras = "tensorflow" in sys.modules
import keras_keepgrad as kg

after_import = "tensorflow" in sys.modules
inputs = keras.Input((1,))
dense = keras.layers.Dense(
    1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0), name="dense_0"
)
model = kg.KeepGradModel(inputs, dense(inputs))
model.compile(
    optimizer=keras.optimizers.SGD(0.1),
    loss="mse",
    metrics=[
        kg.metrics.GradientNorm(),
        kg.metrics.GradientNorm(per_layer=True, name="layer_norm"),
        kg.metrics.NonFiniteGradients(),
        kg.metrics.VanishingGradients(),
        kg.metrics.GradientMaxAbs(),
        kg.metrics.UpdateRatio(),
        kg.metrics.GradientNoiseScale(accumulation_steps=2),
        kg.metrics.GradientSNR(accumulation_steps=2),
        kg.metrics.GradientCosine(),
    ],
)
history = model.fit(
    np.array([[1.0], [2.0]]), np.zeros((2, 1)), batch_size=2, epochs=3, verbose=0,
    callbacks=[kg.callbacks.GradientMonitor()],
)
print(json.dumps({
    "after keras": after_keras,
    "after import": after_import,
    "after fit": "tensorflow" in sys.modules,
    "grad_norm": history.history["grad_norm"],
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_tensorflow_is_not_imported_off_its_backend(backend):
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TENSORFLOW],
        cwd=REPO,
        env=python_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The gradient 5w = 15, and SGD(0.1) halves w every step.
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "after keras": False,
        "after import": False,
        "after fit": False,
        "grad_norm": [15.0, 7.5, 3.75],
    }
