"""Tests for keras_keepgrad.callbacks.snapshot: GradientSnapshot.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import glob
import os

import keras
import numpy as np
import pytest
from callback_helpers import hand_data
from callback_helpers import hand_model
from callback_helpers import tape_gradients
from callback_helpers import two_layer_model
from conftest import Recorder

from keras_keepgrad import callbacks


def test_snapshot_files_equal_the_kept_gradients(tmp_path):
    model = two_layer_model()
    x = np.arange(8, dtype="float32").reshape(4, 2)
    tape = tape_gradients(two_layer_model(cls=keras.Model), x, np.ones((4, 1)), 1, 2)
    recorder = Recorder()
    every = callbacks.GradientSnapshot(tmp_path / "every" / "g-{step:03d}.npz", every=2)
    latest = callbacks.GradientSnapshot(tmp_path / "latest.npz")
    model.fit(
        x,
        np.ones((4, 1)),
        batch_size=1,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, every, latest],
    )
    assert [os.path.basename(f) for f in every.files] == [f"g-{s:03d}.npz" for s in (2, 4, 6, 8)]
    for filename, step in zip(every.files, (2, 4, 6, 8)):
        with np.load(filename) as data:
            assert int(data["step"]) == step and int(data["epoch"]) == (step - 1) // 4 + 1
            assert float(data["loss_scale"]) == 1.0
            kept = recorder.grads[step - 1]
            assert sorted(set(data.files) - {"step", "epoch", "loss_scale"}) == sorted(kept)
            for path, grad in kept.items():
                np.testing.assert_array_equal(data[path], grad)
                np.testing.assert_allclose(data[path], tape[step - 1][path], rtol=1e-6)
    # Without a field, each epoch replaces the file.
    assert latest.files == [str(tmp_path / "latest.npz")] * 2
    with np.load(latest.files[-1]) as data:
        assert int(data["step"]) == 8
        np.testing.assert_array_equal(data["dense_1/kernel"], recorder.grads[-1]["dense_1/kernel"])
    assert not glob.glob(str(tmp_path / "**" / "*.tmp"), recursive=True)


def test_snapshot_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    model = hand_model()
    x, y = hand_data(2)
    target = tmp_path / "latest.npz"
    snapshot = callbacks.GradientSnapshot(target, every=1)
    real_savez = np.savez
    calls = []

    def savez_then_fail(file, **arrays):
        calls.append(arrays["step"])
        if len(calls) == 2:  # Half a file, then the disk is full.
            file.write(b"PK\x03\x04 partial")
            raise OSError(28, "No space left on device")
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.warns(UserWarning, match="could not write .*No space left"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot])
    assert snapshot.files == [str(target)]
    with np.load(target) as data:  # still the whole first snapshot
        assert int(data["step"]) == 1 and float(data["dense_0/kernel"][0, 0]) == 15.0
    assert os.listdir(tmp_path) == ["latest.npz"]


def test_snapshot_removes_only_its_own_stale_temporaries(tmp_path):
    # A process killed mid-write leaves `.<file name>.<12 hex>.tmp`; the
    # next `fit` removes those of the files it would write, nothing else.
    stale = [".g_042.npz.0123456789ab.tmp", ".g_7.npz.fedcba987654.tmp"]
    kept = [
        ".other.tmp",
        "g_1.npz",
        "notes.txt",
        ".g_042.npz.0123456789ab.tmp.bak",  # not a temporary's name
        ".g_x.npz.0123456789ab.tmp",  # not a step
        ".h_042.npz.0123456789ab.tmp",  # another file's
        ".g_042.npz.0123456789a.tmp",  # 11 hex digits
        "g_042.npz.0123456789ab.tmp",  # not hidden
    ]
    for name in stale + kept:
        (tmp_path / name).write_text(name)
    # With `{epoch}` in the directory: each epoch's directory that exists.
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / ".g.npz.00000000abcd.tmp").write_text("stale")
    (tmp_path / "e1" / "g.npz").write_text("an earlier file")
    model = hand_model()
    x, y = hand_data(1)
    steps = callbacks.GradientSnapshot(tmp_path / "g_{step:03d}.npz", every=1)
    epochs = callbacks.GradientSnapshot(tmp_path / "e{epoch}" / "g.npz", every="epoch")
    fit_begins = []

    class AtBegin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            fit_begins.append(sorted(os.listdir(tmp_path)))

    model.fit(x, y, batch_size=2, verbose=0, callbacks=[steps, epochs, AtBegin()])
    assert fit_begins == [sorted(kept + ["e1"])]  # gone before the first step
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["e1", "g_001.npz"])
    for name in kept:
        assert (tmp_path / name).read_text() == name
    assert os.listdir(tmp_path / "e1") == ["g.npz"]
    with np.load(tmp_path / "g_001.npz") as data:
        assert data["dense_0/kernel"].tolist() == [[15.0]]
