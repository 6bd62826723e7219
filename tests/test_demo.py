"""The README's main job: `python -m keras_keepgrad.demo --logdir DIR`."""

import csv
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keras_keepgrad import demo


def test_verdicts_by_hand():
    assert demo.verdict([1e-6, 2e-6]) == "vanishing"
    assert demo.verdict([0.5, 0.1]) == "ok"
    assert demo.verdict([2e3, 4e3]) == "exploding"
    assert demo.verdict([0.5, math.nan]) == "NON-FINITE"


def test_demo_runs_and_shows_the_vanishing_layers(tmp_path, capsys):
    assert demo.main(["--logdir", str(tmp_path), "--epochs", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "sigmoid_grad_norms.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0][:3] == ["step", "dense_0", "dense_1"] and rows[0][-1] == "out"
    assert len(rows) == 1 + 16  # 2048 samples / batch 128, one epoch
    first = [float(r[1]) for r in rows[1:]]
    last = [float(r[-1]) for r in rows[1:]]
    # Sigmoid: the first layer's gradients are orders of magnitude smaller.
    assert max(first) < 1e-3 * min(last)
    sigmoid_table = out.split("== relu_bn")[0]
    assert "vanishing" in sigmoid_table
    relu_table = out.split("== relu_bn")[1]
    relu_rows = relu_table.split("verdict")[1].split("Done in")[0]
    assert "vanishing" not in relu_rows and "NON-FINITE" not in relu_rows
    assert "vanishing layers 0%" in relu_table
    # The monitor named the first layer; the panels are on disk.
    assert "GradientMonitor: Step" in sigmoid_table and "'dense_0'" in sigmoid_table
    assert f"tensorboard --logdir {tmp_path}" in out
    acc = EventAccumulator(str(tmp_path / "sigmoid" / "train"))
    acc.Reload()
    tags = acc.Tags()
    assert "gradients/log10_norm/dense_0" in tags["tensors"] + tags["scalars"]
    assert "dense_0/kernel/gradient" in tags["tensors"] + tags["histograms"]


def test_demo_rejects_an_unwritable_logdir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert demo.main(["--logdir", str(blocker / "sub"), "--quiet"]) == 2
    assert "--logdir" in capsys.readouterr().err
