"""The tutorials as pages: prose, code and recorded outputs.

Each `tutorials/<name>.py` is a percent-format script: `# %% [markdown]`
cells of prose (commented Markdown) and `# %%` cells of code. As an MkDocs
hook (`hooks:` in `mkdocs.yml`) this module turns each into the page
`tutorials/<name>.md`: the prose as Markdown, each code cell followed by
what it printed. Running the tutorials takes minutes, longer than a docs
build should, so their outputs are recorded once, by running each with
`--fast` on TensorFlow, into `tutorials/outputs/<name>.txt`, and the build
only reads them. A record names the code cell each output belongs to by a
hash of its code: a record that no longer matches its tutorial is a build
warning (an error under `mkdocs build --strict`) and a test failure
(`tests/test_tutorials.py`, which also re-runs every tutorial and compares).

Usage:

```shell
python docs/tutorial_pages.py                  # re-record every tutorial's outputs
python docs/tutorial_pages.py quickstart saving
python docs/tutorial_pages.py --check          # which records are stale, without running
```
"""

import argparse
import glob
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = os.path.join(REPO, "tutorials")
OUTPUTS = os.path.join(TUTORIALS, "outputs")
MARKER = "<<<tutorial-cell-end>>>"

log = logging.getLogger("mkdocs.hooks.tutorial_pages")


def tutorial_names():
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(TUTORIALS, "*.py")))


def read_cells(path):
    """The script's cells, in order, as `("markdown" | "code", text)`."""
    with open(path) as f:
        lines = f.read().splitlines()
    cells = []
    for line in lines:
        if line.startswith("# %%"):
            cells.append(["markdown" if "[markdown]" in line else "code", []])
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"{path}: a line before the first `# %%` cell: {line!r}")
    result = []
    for kind, body in cells:
        text = "\n".join(body).strip("\n")
        if kind == "markdown":
            text = lists_apart("\n".join(re.sub(r"^# ?", "", line) for line in text.splitlines()))
        result.append((kind, text))
    return result


_ITEM = re.compile(r"^(?:[-*+]|\d+\.) ")


def lists_apart(text):
    """A blank line before each list that follows a paragraph line.

    Jupyter's Markdown starts a list right after a paragraph line, as the
    tutorials are written; Python-Markdown needs the blank line.
    """
    lines = []
    for line in text.splitlines():
        previous = lines[-1] if lines else ""
        if _ITEM.match(line) and previous.strip() and not previous.startswith((" ", "\t")):
            if not _ITEM.match(previous):
                lines.append("")
        lines.append(line)
    return "\n".join(lines)


def code_cells(name):
    path = os.path.join(TUTORIALS, name + ".py")
    return [text for kind, text in read_cells(path) if kind == "code"]


def code_hash(code):
    return hashlib.sha256(code.encode()).hexdigest()[:12]


# Run in a subprocess: executes the cells one by one in the script's own
# namespace, as `python <path> --fast` would, and ends each cell's output
# with a marker line so that the outputs can be told apart.
_RUNNER = """
import json, sys
path, marker, cells = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
sys.argv = [path, "--fast"]
namespace = {"__name__": "__main__", "__file__": path}
for code in cells:
    exec(compile(code, path, "exec"), namespace)
    sys.stdout.flush()
    print(marker, flush=True)
"""

# Keras's progress lines carry timings ("8/8 - 2s - 227ms/step - loss: ...")
# that change from run to run; the record keeps the rest.
_TIMING = re.compile(r"^(\d+/\d+) - \d+m?s - \d+(?:\.\d+)?[mun]?s/step( - |$)", re.M)


def run(name, env=None, cwd=None):
    """Runs `tutorials/<name>.py --fast`; returns the record's text."""
    path = os.path.join(TUTORIALS, name + ".py")
    codes = code_cells(name)
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = REPO
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # The recorded outputs are TensorFlow's.
    env["KERAS_BACKEND"] = "tensorflow"
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, "-c", _RUNNER, path, MARKER],
            input=json.dumps(codes),
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd or tmp,
            timeout=600,
        )
    if result.returncode != 0:
        raise RuntimeError(
            f"tutorials/{name}.py --fast failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
        )
    outputs = result.stdout.split(MARKER + "\n")[:-1]
    assert len(outputs) == len(codes), (len(outputs), len(codes))
    parts = [f"# Outputs of `python tutorials/{name}.py --fast`, one section per code cell.\n"]
    for code, out in zip(codes, outputs):
        parts.append(f"# %% {code_hash(code)}\n" + _TIMING.sub(r"\1\2", out))
    return "".join(parts)


def read_record(name):
    """`[(code hash, output)]` from `tutorials/outputs/<name>.txt`, or None."""
    path = os.path.join(OUTPUTS, name + ".txt")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read()
    sections = re.split(r"^# %% ([0-9a-f]{12})\n", text, flags=re.M)[1:]
    return list(zip(sections[0::2], sections[1::2]))


def stale(name):
    """Why the record of `name` does not match its tutorial, or None."""
    record = read_record(name)
    if record is None:
        return f"tutorials/outputs/{name}.txt is missing"
    if [code_hash(c) for c in code_cells(name)] != [h for h, _ in record]:
        return f"tutorials/outputs/{name}.txt was recorded from other code than {name}.py's"
    return None


def noqa_free(code):
    # The linter's hints are for the script, not the reader.
    return re.sub(r"  # noqa: [A-Z0-9, ]+$", "", code, flags=re.M)


def render(name):
    """The Markdown page of `tutorials/<name>.py`, with its recorded outputs."""
    cells = read_cells(os.path.join(TUTORIALS, name + ".py"))
    record = read_record(name) or []
    why = stale(name)
    outputs = [] if why else [out for _, out in record]
    parts = []
    code_index = 0
    for index, (kind, text) in enumerate(cells):
        if kind == "markdown":
            parts.append(text)
            if index == 0:
                parts.append(
                    f"The outputs below are those of `python tutorials/{name}.py --fast` on"
                    " TensorFlow (CPU), without the progress bar's timings."
                )
            continue
        parts.append(f"```python\n{noqa_free(text)}\n```")
        out = outputs[code_index] if code_index < len(outputs) else ""
        code_index += 1
        if out.strip():
            parts.append(f'``` {{.text .tutorial-output title="Output"}}\n{out.rstrip()}\n```')
    return "\n\n".join(parts) + "\n"


# -- MkDocs hooks -------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    for name in tutorial_names():
        why = stale(name)
        if why:
            log.warning(f"{why}: run `python docs/tutorial_pages.py {name}`")
        files.append(File.generated(config, f"tutorials/{name}.md", content=render(name)))
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="tutorials to record (default: all)")
    parser.add_argument("--check", action="store_true", help="list stale records, run nothing")
    args = parser.parse_args()
    names = args.names or tutorial_names()
    if args.check:
        problems = [why for why in map(stale, names) if why]
        print("\n".join(problems) or "all records are current")
        return 1 if problems else 0
    os.makedirs(OUTPUTS, exist_ok=True)
    for name in names:
        text = run(name)
        with open(os.path.join(OUTPUTS, name + ".txt"), "w") as f:
            f.write(text)
        print(f"recorded tutorials/outputs/{name}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
