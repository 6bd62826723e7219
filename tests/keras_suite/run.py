"""Keras's own tests, run on plain Keras and on `KeepGradModel`.

Copies Keras's test files for models, saving, callbacks and trainers from
the installed wheel into two trees: "plain", as shipped, and "kept", where
every model the tests build, subclass or mix in is a `KeepGradModel`
(`keepgrad_substitutes.py` says how). Runs pytest on both and fails on any
test that passes plain and does not pass kept (fails, errors, is skipped or
is missing), unless `known_differences.txt` lists it with a reason.
`--backend` picks Keras's backend for both trees (TensorFlow by default).

A test that passes kept is no difference whatever it does plain, so by
default the plain tree runs only the tests it collects that did not pass
kept (`--full-plain` runs all of it, beside the kept tree).

    python3 tests/keras_suite/run.py                  # everything, ~7 min
    python3 tests/keras_suite/run.py --files 'models/*'
    python3 tests/keras_suite/run.py -k fit_with_val  # passed on to pytest
    python3 tests/keras_suite/run.py --backend torch --files 'trainers/*'

The "kept" tree imports `keras_keepgrad` from this repository.
"""

import argparse
import ast
import concurrent.futures
import fnmatch
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Found without importing Keras (and TensorFlow) into the driver.
KERAS_SRC = os.path.join(os.path.dirname(importlib.util.find_spec("keras").origin), "src")

FILES = (
    "models/*_test.py",
    "saving/*_test.py",
    "callbacks/*_test.py",
    "trainers/*_test.py",
)

# Files that cannot run on this machine at all, with the reason.
DROPPED_FILES = {
    "callbacks/orbax_checkpoint_test.py": (
        "imports orbax (keras.src.callbacks.orbax_checkpoint), not installed; "
        "its distributed tests are JAX-only"
    ),
}

KNOWN_DIFFERENCES = os.path.join(HERE, "known_differences.txt")
BACKENDS = ("tensorflow", "jax", "torch")

# Names a kept file keeps as Keras's, with the reason.
KEEP_KERAS_NAMES = {
    "models/sequential_test.py": {
        "Functional": "it names the class of a Sequential's inner model "
        "(`type(model._functional)`), which is Keras's own",
    },
}

_SUBSTITUTE = (
    "import keepgrad_substitutes as _keras_suite  # noqa: E402\n"
    "_keras_suite.substitute(globals(), keep={keep!r})\n"
)
# Textual edits of a kept file: (old, new, how many times, why).
KEPT_EDITS = {
    "trainers/trainer_test.py": [
        (
            "self.layers",
            "self.dense_layers",
            3,
            "test_loss_scaling_prevents_underflow's DeepModel, a Layer with the "
            "Trainer mixed in, sets `self.layers`, which `keras.Model` reserves",
        ),
        (
            "first_kernel = model.layers[0].kernel",
            "first_kernel = model.dense_layers[0].kernel",
            2,
            "the same",
        ),
    ],
}

_JAX_IMPORT = "import jax\n"
_JAX_GUARDED = (
    "try:\n"
    "    import jax\n"
    "except ImportError:  # only the JAX backend's tests use it\n"
    "    jax = None\n"
)
# `class M(Trainer, layers.Dense)`; `layers.Layer` itself can stay second
# (a `KeepGradModel` is one already).
_MIXIN = re.compile(r"^(\s*)class (\w+)\(Trainer, (?!layers\.Layer\))([\w.]+)\):", re.MULTILINE)


def selected_files(patterns):
    files = []
    for pattern in FILES:
        for path in sorted(glob.glob(os.path.join(KERAS_SRC, pattern))):
            rel = os.path.relpath(path, KERAS_SRC)
            if rel in DROPPED_FILES:
                continue
            if patterns and not any(fnmatch.fnmatch(rel, p) for p in patterns):
                continue
            files.append(rel)
    return files


def _insert_substitution(source, rel):
    """`source` with `substitute(globals())` before its first def or class.

    Module-level classes take their bases when the module runs, so the
    names must be rebound before the first of them.
    """
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            line = min([node.lineno] + [d.lineno for d in node.decorator_list])
            break
    else:
        raise RuntimeError(f"{rel}: no top-level def or class")
    lines = source.splitlines(keepends=True)
    keep = sorted(KEEP_KERAS_NAMES.get(rel, {}))
    return "".join(lines[: line - 1]) + _SUBSTITUTE.format(keep=keep) + "".join(lines[line - 1 :])


def transform(source, rel, variant):
    """The test file `rel` as the `variant` tree runs it."""
    if rel == "trainers/trainer_test.py":
        if _JAX_IMPORT not in source:
            raise RuntimeError(f"{rel}: no top-level `import jax` to guard")
        source = source.replace(_JAX_IMPORT, _JAX_GUARDED, 1)
    if variant == "plain":
        return source
    source = source.replace(
        "from keras.src.saving import saving_lib_test",
        "from saving import saving_lib_test",
    )
    for old, new, count, _ in KEPT_EDITS.get(rel, []):
        if source.count(old) != count:
            raise RuntimeError(f"{rel}: {old!r} occurs {source.count(old)} times, not {count}")
        source = source.replace(old, new)
    if rel == "trainers/trainer_test.py":
        # The layer's methods first: see `KeepGradTrainer`.
        source, count = _MIXIN.subn(r"\1class \2(\3, Trainer):", source)
        if count == 0:
            raise RuntimeError(f"{rel}: no `class X(Trainer, layers.Y)` mix-in")
    return _insert_substitution(source, rel)


def write_tree(root, files, variant):
    os.makedirs(root)
    shutil.copy(os.path.join(HERE, "suite_conftest.py"), os.path.join(root, "conftest.py"))
    if variant == "kept":
        shutil.copy(os.path.join(HERE, "keepgrad_substitutes.py"), root)
    with open(os.path.join(root, "pytest.ini"), "w") as f:
        f.write("[pytest]\naddopts = -p no:cacheprovider\n")
    helpers = []
    if variant == "kept" and "models/variable_mapping_test.py" in files:
        helpers.append("saving/saving_lib_test.py")  # it builds the models
    for rel in dict.fromkeys(files + helpers):
        with open(os.path.join(KERAS_SRC, rel)) as f:
            source = f.read()
        target = os.path.join(root, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(transform(source, rel, variant))


# On JAX, two host CPU devices: trainer_test.py's distributed test
# (`test_jit_fit_with_out_shardings_logic_distributed`) needs two, and skips
# on one; Keras's single-device tests do not change with it.
_JAX_DEVICES = "--xla_force_host_platform_device_count=2"


def _tree_env(root, backend, **extra):
    env = dict(os.environ)
    if backend == "jax" and "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_JAX_DEVICES}".strip()
    env.update(
        KERAS_BACKEND=backend,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join([root, REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **extra,
    )
    return env


def collect_tree(root, files, pytest_args, timeout, backend="tensorflow"):
    """The test ids pytest collects in `root` (without running them)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", *pytest_args, *files],
        cwd=root,
        env=_tree_env(root, backend),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return [line.strip() for line in result.stdout.splitlines() if "::" in line]


def run_tree(root, files, pytest_args, timeout, backend="tensorflow"):
    """Runs pytest in `root` on `files` (paths or test ids); returns
    (outcomes, seconds, log path)."""
    outcomes_path = os.path.join(root, "outcomes.json")
    log_path = os.path.join(root, "pytest.log")
    env = _tree_env(root, backend, KERAS_SUITE_OUTCOMES=outcomes_path)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rN",
        "--continue-on-collection-errors",
        *pytest_args,
        *files,
    ]
    start = time.monotonic()
    with open(log_path, "w") as log:
        subprocess.run(
            command,
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    seconds = time.monotonic() - start
    if not os.path.exists(outcomes_path):
        raise RuntimeError(f"pytest in {root} wrote no outcomes; see {log_path}")
    with open(outcomes_path) as f:
        return json.load(f), seconds, log_path


def read_known_differences(path, backend="tensorflow"):
    """`{pattern: reason}` for `backend`, from lines
    `[<backend>] <test id pattern>  # <reason>`; a line without a
    `[<backend>]` prefix holds on every backend."""
    known = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            pattern, _, reason = line.partition("#")
            pattern, reason = pattern.strip(), reason.strip()
            only = None
            prefix = re.match(r"\[(\w*)\]\s*", pattern)
            if prefix:
                only, pattern = prefix.group(1), pattern[prefix.end() :]
                if only not in BACKENDS:
                    raise ValueError(
                        f"{path}:{number}: the prefix must be one of "
                        f"{', '.join(f'[{b}]' for b in BACKENDS)}, or none for every "
                        f"backend. Received: [{only}]"
                    )
            if not reason:
                raise ValueError(f"{path}:{number}: {pattern} has no `# reason`")
            if only in (None, backend):
                known[pattern] = reason
    return known


def plain_needed(collected, kept):
    """The plain tests whose outcome can make a difference: those of
    `collected` that did not pass kept (failed, errored, skipped, missing)."""
    return [t for t in collected if kept.get(t, {}).get("outcome") != "passed"]


def differences(plain, kept):
    """`{test id: (kept outcome, message)}` for tests that pass plain only."""
    found = {}
    for test_id, result in sorted(plain.items()):
        if result["outcome"] != "passed":
            continue
        # A kept file that fails to import leaves its tests missing.
        other = kept.get(test_id) or kept.get(
            test_id.split("::")[0], {"outcome": "missing", "message": ""}
        )
        if other["outcome"] != "passed":
            found[test_id] = (other["outcome"], other["message"])
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--files", nargs="*", default=[], help="globs of test files relative to keras/src"
    )
    parser.add_argument("-k", default=None, help="passed on to pytest")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="tensorflow",
        help="Keras backend of both trees (default: tensorflow)",
    )
    parser.add_argument(
        "--full-plain",
        action="store_true",
        help="run every plain test, beside the kept tree, not only those that did not pass kept",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="read the plain outcomes from this JSON instead of running them",
    )
    parser.add_argument(
        "--save-baseline", default=None, help="write the plain outcomes to this JSON"
    )
    parser.add_argument(
        "--report", default=None, help="write every difference, as JSON, to this file"
    )
    parser.add_argument("--keep-dir", action="store_true", help="keep the copied trees and logs")
    parser.add_argument(
        "--timeout", type=float, default=25 * 60, help="seconds for each tree's pytest"
    )
    args = parser.parse_args(argv)
    if args.save_baseline and not args.full_plain:
        parser.error("--save-baseline needs --full-plain: a baseline holds every plain outcome")

    files = selected_files(args.files)
    if not files:
        parser.error(f"no test files match {args.files}")
    pytest_args = ["-k", args.k] if args.k else []
    work = tempfile.mkdtemp(prefix="keras_suite_")
    variants = ["kept"] if args.baseline else ["plain", "kept"]
    for variant in variants:
        write_tree(os.path.join(work, variant), files, variant)
    print(
        f"keras_suite: {len(files)} files from {KERAS_SRC} on {args.backend}, in {work}",
        flush=True,
    )

    if args.full_plain and not args.baseline:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                variant: pool.submit(
                    run_tree,
                    os.path.join(work, variant),
                    files,
                    pytest_args,
                    args.timeout,
                    args.backend,
                )
                for variant in variants
            }
            results = {variant: future.result() for variant, future in futures.items()}
    else:
        results = {
            "kept": run_tree(
                os.path.join(work, "kept"), files, pytest_args, args.timeout, args.backend
            )
        }
    kept, seconds, _ = results["kept"]
    print(f"kept:  {_counts(kept)} in {seconds:.0f} s")

    if args.baseline:
        with open(args.baseline) as f:
            plain = json.load(f)
        plain = {k: v for k, v in plain.items() if k.split("::")[0] in files}
    elif "plain" in results:
        plain, seconds, _ = results["plain"]
        print(f"plain: {_counts(plain)} in {seconds:.0f} s")
    else:
        root = os.path.join(work, "plain")
        collected = collect_tree(root, files, pytest_args, args.timeout, args.backend)
        if not collected:
            raise RuntimeError(f"pytest collected no tests in {root}")
        needed = plain_needed(collected, kept)
        plain, seconds = {}, 0.0
        if needed:
            plain, seconds, _ = run_tree(root, needed, [], args.timeout, args.backend)
        print(
            f"plain: {_counts(plain) or 'nothing'} in {seconds:.0f} s, of the "
            f"{len(needed)} of {len(collected)} tests that did not pass kept"
        )
    if args.save_baseline and args.full_plain:
        with open(args.save_baseline, "w") as f:
            json.dump(plain, f, indent=1, sort_keys=True)

    known = read_known_differences(KNOWN_DIFFERENCES, args.backend)
    found = differences(plain, kept)
    explained, unexplained, used = {}, {}, set()
    for test_id, (outcome, message) in found.items():
        pattern = next((p for p in known if fnmatch.fnmatchcase(test_id, p)), None)
        if pattern is None:
            unexplained[test_id] = (outcome, message)
        else:
            used.add(pattern)
            explained[test_id] = (outcome, message, known[pattern])

    if args.report:
        with open(args.report, "w") as f:
            json.dump(
                {
                    "unexplained": {k: list(v) for k, v in unexplained.items()},
                    "known": {k: list(v) for k, v in explained.items()},
                },
                f,
                indent=1,
                sort_keys=True,
            )
    failing = sorted(k for k, v in plain.items() if v["outcome"] in ("failed", "error"))
    print(f"\n{len(failing)} tests fail on plain Keras here (not compared):")
    for test_id in failing:
        print(f"  {test_id}: {plain[test_id]['message'][:200]}")
    print(f"\n{len(explained)} known differences (known_differences.txt):")
    for test_id, (outcome, message, reason) in explained.items():
        print(f"  {test_id}: {outcome}: {message}\n      because: {reason}")
    stale = [p for p in known if p not in used and _selected(p, files, args.k)]
    if stale:
        print(f"\n{len(stale)} known differences that did not occur:")
        for pattern in stale:
            print(f"  {pattern}")
    print(f"\n{len(unexplained)} tests pass on plain Keras and not on KeepGradModel:")
    for test_id, (outcome, message) in unexplained.items():
        print(f"  {test_id}: {outcome}: {message}")
    if args.keep_dir:
        print(f"\ntrees and pytest logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if unexplained else 0


def _counts(outcomes):
    counts = {}
    for result in outcomes.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))


def _selected(pattern, files, keyword):
    """Whether a run of `files` (and `-k keyword`) could see `pattern`."""
    if keyword:
        return False
    return any(fnmatch.fnmatchcase(f, pattern.split("::")[0]) for f in files)


if __name__ == "__main__":
    sys.exit(main())
