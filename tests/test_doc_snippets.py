"""Every ```python block of the README and of docs/*.md runs as it stands.

Each block is executed on its own, in a fresh namespace after
`keras.backend.clear_session()` (so that layer names count from scratch, as
in a new interpreter), in one process per page and backend: on TensorFlow,
unless the block sets `os.environ["KERAS_BACKEND"]` itself. A comment
`# -> TEXT` in a block is a promise about what it prints: some line of the
block's output is TEXT, where `...` stands for anything.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from conftest import python_env

PAGES = ["README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
)
MARKER = "<<<doc-snippet-end>>>"

_RUNNER = """
import json, sys
import keras
blocks, marker = json.loads(sys.stdin.read()), sys.argv[1]
for index, code in blocks:
    keras.backend.clear_session()
    exec(compile(code, f"<python block {index}>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    print(marker, flush=True)
"""


def python_blocks(page):
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def backend_of(block):
    found = re.search(r"""os\.environ\["KERAS_BACKEND"\] = "(\w+)\"""", block)
    return found.group(1) if found else "tensorflow"


def promises(block):
    """The block's `# -> TEXT` comments, as regular expressions for one line."""
    texts = re.findall(r"# -> (.*)$", block, re.M)
    return [
        "^" + ".*".join(re.escape(part) for part in text.strip().split("...")) + "$"
        for text in texts
    ]


CASES = [
    (page, backend)
    for page in PAGES
    for backend in sorted({backend_of(b) for b in python_blocks(page)})
]


def test_the_pages_have_python_blocks():
    counts = {page: len(python_blocks(page)) for page in PAGES}
    # The pages whose examples this file runs, with their number of blocks.
    assert {page: n for page, n in counts.items() if n} == {
        "README.md": 3,
        "docs/backends.md": 2,
        "docs/callbacks.md": 4,
        "docs/distributed.md": 2,
        "docs/dynamics.md": 1,
        "docs/index.md": 1,
        "docs/metrics.md": 1,
        "docs/skipping.md": 4,
        "docs/train_step.md": 2,
    }


def test_a_promise_matches_a_whole_line_with_dots_for_anything():
    block = "print(w)  # -> tf.Tensor([[5.]], ...)\nx = 1\n# -> 2 ... 3\n"
    first, second = promises(block)
    assert re.search(first, "a\ntf.Tensor([[5.]], shape=(1, 1), dtype=float32)\n", re.M)
    assert not re.search(first, "tf.Tensor([[7.]], shape=(1, 1))\n", re.M)
    assert not re.search(first, "x tf.Tensor([[5.]], shape=(1, 1))\n", re.M)
    assert re.search(second, "2 and 3\n", re.M)
    assert not re.search(second, "2 and 3.5\n", re.M)
    assert backend_of('import os\nos.environ["KERAS_BACKEND"] = "jax"\n') == "jax"
    assert backend_of("import keras\n") == "tensorflow"


@pytest.mark.slow
@pytest.mark.parametrize("page, backend", CASES, ids=[f"{p}-{b}" for p, b in CASES])
def test_python_blocks_run(page, backend, tmp_path):
    blocks = [
        (index, block)
        for index, block in enumerate(python_blocks(page), 1)
        if backend_of(block) == backend
    ]
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, MARKER],
        input=json.dumps(blocks),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=python_env(KERAS_BACKEND=backend),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    outputs = result.stdout.split(MARKER + "\n")[:-1]
    assert len(outputs) == len(blocks)
    for (index, block), out in zip(blocks, outputs):
        for pattern in promises(block):
            assert re.search(pattern, out, re.M), f"{page}, python block {index}: {pattern}\n{out}"
