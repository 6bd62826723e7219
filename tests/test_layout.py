"""The package's layout: no import cycles, backend code only under `backend/`,
private upstream names only in `_compat.py`."""

import ast
import pathlib
import re
import tokenize

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
    # `model.py` is longer: most of it is the docstrings of what users call.
    core = ["wrapping.py", "_capture.py", "_checks.py", "_compat.py", "_squares.py", "_stats.py"]
    for package in ("backend", "metrics", "callbacks"):
        core += [str(p.relative_to(PACKAGE)) for p in (PACKAGE / package).rglob("*.py")]
    sizes = {name: len((PACKAGE / name).read_text().splitlines()) for name in core}
    assert {name: n for name, n in sizes.items() if n > 460} == {}
