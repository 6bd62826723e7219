"""Every tutorial runs, in its fast mode, and its own asserts hold."""

import glob
import os

import pytest
from conftest import REPO
from conftest import tensorflow_script_output

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
def test_tutorial_runs(path, tmp_path_factory):
    # The same run as the one `test_backends.py` compares with JAX's and
    # PyTorch's: whichever test comes first runs it.
    tensorflow_script_output([path, "--fast"], tmp_path_factory)
