"""The README's main job: `python -m keras_keepgrad.demo --logdir DIR`."""

import csv

import keras
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keras_keepgrad import demo
from keras_keepgrad.callbacks import _health


def test_verdicts_by_hand():
    # The mean norm against 1e-5 and 1e3; any non-finite step first.
    assert _health.verdict(1.5e-6) == "vanishing"
    assert _health.verdict(0.3) == "ok"
    assert _health.verdict(3e3) == "exploding"
    assert _health.verdict(0.5, nonfinite_steps=1) == "non-finite"


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
    assert "vanishing" not in relu_rows and "non-finite" not in relu_rows
    assert "vanishing layers 0%" in relu_table
    # The monitor named the first layer; the panels are on disk.
    assert "GradientMonitor: Step" in sigmoid_table and "'dense_0'" in sigmoid_table
    assert f"tensorboard --logdir {tmp_path}" in out
    assert f"on the {keras.backend.backend()} backend" in out
    # The monitor's summary: dense_0 vanished for the whole run, reported once.
    assert "'dense_0' vanishing: steps 1-16 (16 checks), until the end, the whole run" in out
    assert out.count("GradientMonitor: Step") == 1
    assert (tmp_path / "sigmoid_report.html").read_text().startswith("<!DOCTYPE html>")
    assert (tmp_path / "relu_bn_report.png").read_bytes()[:4] == b"\x89PNG"
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
