"""Every tutorial runs, in its fast mode, its own asserts hold, and the
outputs shown on its page (`tutorials/outputs/`) are what it prints."""

import glob
import os

import pytest
from conftest import REPO
from conftest import pages
from conftest import python_env

TUTORIALS = sorted(glob.glob(os.path.join(REPO, "tutorials", "*.py")))
NAMES = [os.path.basename(p)[:-3] for p in TUTORIALS]


def test_there_are_tutorials():
    names = {os.path.basename(p) for p in TUTORIALS}
    assert {
        "quickstart.py",
        "diagnosing_gradients.py",
        "mixed_precision.py",
        "custom_metric_and_callback.py",
        "saving.py",
        "surviving_a_loss_spike.py",
    } <= names


@pytest.mark.parametrize("name", NAMES)
def test_recorded_outputs_belong_to_the_tutorials_code(name):
    # Fails as soon as a code cell changes: re-record with
    # `python docs/tutorial_pages.py <name>`.
    assert pages.stale(name) is None


def test_a_page_has_the_prose_the_code_and_each_cells_output(tmp_path, monkeypatch):
    tutorials, outputs = tmp_path / "tutorials", tmp_path / "tutorials" / "outputs"
    outputs.mkdir(parents=True)
    (tutorials / "t.py").write_text(
        "# %% [markdown]\n# # Title\n#\n# Some *prose*, and a list:\n# 1. one\n# 2. two\n\n"
        "# %%\nimport os  # noqa: E402\n\n"
        "# %% [markdown]\n# ## Part\n\n"
        "# %%\nprint(1)\nprint(2)\n"
    )
    first, second = "import os  # noqa: E402", "print(1)\nprint(2)"
    (outputs / "t.txt").write_text(
        "# Outputs of `python tutorials/t.py --fast`, one section per code cell.\n"
        f"# %% {pages.code_hash(first)}\n# %% {pages.code_hash(second)}\n1\n2\n"
    )
    monkeypatch.setattr(pages, "TUTORIALS", str(tutorials))
    monkeypatch.setattr(pages, "OUTPUTS", str(outputs))
    assert pages.stale("t") is None
    assert pages.render("t") == (
        "# Title\n\nSome *prose*, and a list:\n\n1. one\n2. two\n\n"
        "The outputs below are those of `python tutorials/t.py --fast` on TensorFlow (CPU),"
        " without the progress bar's timings.\n\n"
        "```python\nimport os\n```\n\n"
        "## Part\n\n"
        "```python\nprint(1)\nprint(2)\n```\n\n"
        '``` {.text .tutorial-output title="Output"}\n1\n2\n```\n'
    )
    # A changed code cell makes the record stale: its outputs are not shown.
    (tutorials / "t.py").write_text((tutorials / "t.py").read_text().replace("(2)", "(3)"))
    assert pages.stale("t") == "tutorials/outputs/t.txt was recorded from other code than t.py's"
    assert "Output" not in pages.render("t")


def test_progress_bar_timings_are_left_out_of_the_record():
    lines = (
        "Epoch 1/2\n8/8 - 2s - 227ms/step - loss: 11.5055\n"
        "3/3 - 0s - 5us/step\n1/1 - 12s - 1s/step - loss: 2.0\n"
    )
    assert pages._TIMING.sub(r"\1\2", lines) == (
        "Epoch 1/2\n8/8 - loss: 11.5055\n3/3\n1/1 - loss: 2.0\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_tutorial_runs_and_prints_its_recorded_outputs(name, tmp_path):
    # Runs `tutorials/<name>.py --fast` cell by cell (its asserts included).
    text = pages.run(name, env=python_env(), cwd=tmp_path)
    with open(os.path.join(REPO, "tutorials", "outputs", name + ".txt")) as f:
        recorded = f.read()
    assert text == recorded, f"re-record with: python docs/tutorial_pages.py {name}"
