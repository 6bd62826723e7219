"""Every tutorial runs, in its fast mode, and its own asserts hold."""

import glob
import os
import subprocess
import sys

import pytest
from conftest import REPO
from conftest import python_env

TUTORIALS = sorted(glob.glob(os.path.join(REPO, "tutorials", "*.py")))


def test_there_are_tutorials():
    names = {os.path.basename(p) for p in TUTORIALS}
    assert {
        "quickstart.py",
        "diagnosing_gradients.py",
        "mixed_precision.py",
        "custom_metric_and_callback.py",
        "saving.py",
    } <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_runs(path, tmp_path):
    env = python_env()
    result = subprocess.run(
        [sys.executable, path, "--fast"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
