"""The README's promises: two commands, and a ten-line example that runs."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from conftest import python_env


def read_readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def test_readme_has_the_demo_and_the_test_command():
    text = read_readme()
    section = text.split("## Two commands")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert commands == [
        'pip install -e ".[cpu]" && python -m keras_keepgrad.demo --logdir runs/demo',
        'pip install -e ".[cpu,test]" && python -m pytest -n auto',
    ]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    # CI installs the test extra (and what lint and docs need), runs the
    # first command in a fresh venv and the tests.
    assert '-e ".[cpu,test,' in ci and "python3 -m pytest -q -n auto" in ci
    assert "bash .ci/fresh_venv_demo.sh" in ci


@pytest.mark.slow
def test_ten_line_example_prints_5():
    text = read_readme()
    example = text.split("## Ten lines")[1].split("```python\n")[1].split("```")[0]
    assert len([l for l in example.splitlines() if l.strip()]) <= 10
    env = python_env()
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, env=env, timeout=300
    )
    assert "tf.Tensor([[5.]]" in out.stdout, out.stderr[-2000:]
