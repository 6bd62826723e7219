"""Tests for keras_keepgrad.callbacks._reading: which kept step callbacks read.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import os
import warnings

import keras
import numpy as np
import pytest
from callback_helpers import hand_data
from callback_helpers import hand_model
from callback_helpers import read_run
from callback_helpers import scalars
from conftest import MODES
from conftest import STEP_IDS
from conftest import LateBuilt
from conftest import Recorder
from conftest import X
from conftest import Y
from conftest import compiled_on_torch_only
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad import callbacks
from keras_keepgrad.callbacks import _skipped


def test_keep_every_callbacks_read_each_kept_step_once_at_its_step(tmp_path):
    # keep_every=2 writes the slots on steps 1, 3 and 5 only: 5w = 15, 3.75
    # and 0.9375 (w halves every step). Between writes the slots hold the
    # last written step; callbacks read each written step once, at its step.
    model = hand_model(keep_every=2, metrics=[kg.metrics.GradientNorm(reduction="mean")])
    board = callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=1)
    snapshot = callbacks.GradientSnapshot(tmp_path / "snap" / "{step}.npz", every=1)
    # 15 and 3.75 are below 20; vanishing for 2 checks in a row is reported
    # at step 3, not at step 2 (a second look at step 1's gradients).
    monitor = callbacks.GradientMonitor(vanishing_threshold=20.0, vanishing_steps=2)
    recorder = Recorder()
    x, y = hand_data(5)
    # (`pytest.warns` would re-raise Keras's TensorBoard deprecation warnings.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=2,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[board, snapshot, monitor, recorder],
        )
    # The report, then the run's summary (steps 1, 3 and 5 were read).
    assert [str(w.message)[:46] for w in caught if w.category is UserWarning] == [
        "GradientMonitor: Step 3: vanishing gradients: ",
        "GradientMonitor: summary of steps 1-5:\n'dense_",
    ]
    assert [float(g["dense_0/kernel"][0, 0]) for g in recorder.grads] == [
        15.0,
        15.0,
        3.75,
        3.75,
        0.9375,
    ]
    expected = [(1, 15.0), (3, 3.75), (5, 0.9375)]
    acc = read_run(str(tmp_path / "logs" / "train"))
    assert scalars(acc, "gradients/log10_norm/dense_0") == [
        (step, float(np.float32(np.log10(value)))) for step, value in expected
    ]
    assert [os.path.basename(f) for f in snapshot.files] == ["1.npz", "3.npz", "5.npz"]
    for filename, (step, value) in zip(snapshot.files, expected):
        with np.load(filename) as data:
            assert int(data["step"]) == step
            assert data["dense_0/kernel"].tolist() == [[value]]
    assert [(e["kind"], e["step"]) for e in monitor.events] == [("vanishing", 3)]
    # Metrics see every step's gradients, written or not: the epoch's mean is
    # (15 + 7.5 + 3.75 + 1.875 + 0.9375) / 5, not (15 + 15 + 3.75 + ...) / 5.
    assert history.history["grad_norm"] == [5.8125]


def test_keep_every_labels_a_read_step_with_the_epoch_it_ran_in(tmp_path):
    # 5 batches per epoch, epochs 2 and 3 (initial_epoch=2), lr 0: 5w = 15,
    # but batch 5 of each epoch is doubled: 15 * 2^2 = 60. keep_every=2
    # writes steps 1, 3, 5, 7, 9; checks every 3 batches, after steps 3, 6
    # and 9, read steps 3, 5 and 9. Step 5 is epoch 2's last batch, read
    # while epoch 3 runs: it is labelled epoch 2 (file "e3", 1-based).
    model = hand_model(lr=0.0, keep_every=2)
    x, y = hand_data(5)
    x[8:] *= 2.0
    snapshot = callbacks.GradientSnapshot(tmp_path / "e{epoch}_s{step}.npz", every=3)
    monitor = callbacks.GradientMonitor(exploding_threshold=40.0, check_freq=3)
    with (
        pytest.warns(UserWarning, match=r"summary of steps 3-9:\n'dense_0' exploding: steps 5-5"),
        pytest.warns(UserWarning, match=r"Step 5: exploding gradients: global norm 60 "),
    ):
        model.fit(
            x,
            y,
            batch_size=2,
            epochs=4,
            initial_epoch=2,
            shuffle=False,
            verbose=0,
            callbacks=[snapshot, monitor],
        )
    found = []
    for filename in snapshot.files:
        with np.load(filename) as data:
            found.append(
                (
                    os.path.basename(filename),
                    int(data["step"]),
                    int(data["epoch"]),
                    float(data["dense_0/kernel"][0, 0]),
                )
            )
    assert found == [
        ("e3_s3.npz", 3, 3, 15.0),
        ("e3_s5.npz", 5, 3, 60.0),
        ("e4_s9.npz", 9, 4, 15.0),
    ]
    assert [(e["kind"], e["step"], e["epoch"]) for e in monitor.events] == [("exploding", 5, 2)]


@pytest.mark.backends(
    "tensorflow", "jax", reason="Keras's PyTorch trainer refuses steps_per_execution > 1"
)
def test_keep_every_labels_across_executions_and_fits(tmp_path):
    # keep_every=3 and steps_per_execution=2: callbacks run after steps 2, 4
    # of each fit. The count of steps goes on across fits: writes on global
    # steps 1, 4, 7 (5w: 15, 1.875, 0.234375; w halves every step).
    model = hand_model(keep_every=3, steps_per_execution=2)
    x, y = hand_data(4)

    def fit(name):
        snapshot = callbacks.GradientSnapshot(tmp_path / name / "{step}.npz", every=1)
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot])
        found = []
        for filename in snapshot.files:
            with np.load(filename) as data:
                found.append(
                    (
                        os.path.basename(filename),
                        int(data["step"]),
                        float(data["dense_0/kernel"][0, 0]),
                    )
                )
        return found

    # Fit 1: after step 2 the slots hold step 1's (one step old), after
    # step 4 step 4's.
    assert fit("first") == [("1.npz", 1, 15.0), ("4.npz", 4, 1.875)]
    # Fit 2 (global steps 5-8): after its step 2 the slots still hold fit
    # 1's step 4, which is not this fit's and is skipped; after its step 4,
    # global step 7, its step 3.
    assert fit("second") == [("3.npz", 3, 0.234375)]


@pytest.mark.parametrize(
    "own_step",
    compiled_on_torch_only(
        [False, True],
        [True],
        reason="Keras's step: test_metrics_of_a_model_built_by_its_first_batch",
        ids=STEP_IDS.get,
    ),
)
@pytest.mark.parametrize("mode", list(MODES))
def test_callbacks_of_a_model_built_by_its_first_batch(tmp_path, mode, own_step):
    # 5w = 15, then w = 3 - 0.1 * 15 = 1.5 and 5w = 7.5.
    model = LateBuilt(own_step=own_step, name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **MODES[mode])
    snapshot = callbacks.GradientSnapshot(tmp_path / "g_{step}.npz", every=1)
    board = callbacks.GradientTensorBoard(tmp_path / "logs", update_freq=1)
    monitor = callbacks.GradientMonitor(exploding_threshold=10.0)
    x, y = hand_data(2)
    # (`pytest.warns` would re-raise Keras's TensorBoard deprecation warnings.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[snapshot, board, monitor]
        )
    assert [str(w.message)[:56] for w in caught if w.category is UserWarning] == [
        "GradientMonitor: Step 1: exploding gradients: global nor",
        "GradientMonitor: summary of steps 1-2:\n'net/dense_0' exp",
    ]
    assert snapshot.files == [str(tmp_path / "g_1.npz"), str(tmp_path / "g_2.npz")]
    found = []
    for filename in snapshot.files:
        with np.load(filename) as data:
            assert sorted(data.files) == ["epoch", "loss_scale", "net/dense_0/kernel", "step"]
            found.append(
                (
                    int(data["step"]),
                    int(data["epoch"]),
                    float(data["loss_scale"]),
                    data["net/dense_0/kernel"].tolist(),
                )
            )
    assert found == [(1, 1, 1.0, [[15.0]]), (2, 1, 1.0, [[7.5]])]
    acc = read_run(str(tmp_path / "logs" / "train"))
    assert scalars(acc, "gradients/log10_norm/net/dense_0") == [
        (1, float(np.float32(np.log10(15.0)))),
        (2, float(np.float32(np.log10(7.5)))),
    ]
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [
        ("exploding", 1, ["net/dense_0"])
    ]


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_callbacks_read_every_step(tmp_path, dtype):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    # 15, 7.5, 3.75 and SGD(0.1)'s steps between them are exact in bfloat16.
    model = one_weight(dtype=dtype)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    monitor = kg.callbacks.GradientMonitor(check_freq=1)
    callbacks = [
        kg.callbacks.GradientTensorBoard(
            str(tmp_path / "tb"), update_freq=1, gradient_histogram_freq=1
        ),
        monitor,
        kg.callbacks.GradientSnapshot(str(tmp_path / "snap" / "{step:03d}.npz"), every=1),
    ]
    model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    snaps = [np.load(tmp_path / "snap" / f"{step:03d}.npz") for step in (1, 2, 3)]
    assert [float(s["dense_0/kernel"][0, 0]) for s in snaps] == [15.0, 7.5, 3.75]
    assert snaps[0]["dense_0/kernel"].dtype == np.float32  # bfloat16 is stored as float32
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb" / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()

    def written(tag):
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]

    # log10 of each norm, written once, as float32; the layer's tag is its path.
    log10 = [(s, float(np.float32(np.log10(v)))) for s, v in [(1, 15.0), (2, 7.5), (3, 3.75)]]
    assert written("gradients/log10_norm/dense_0") == log10
    assert written("gradients/log10_global_norm") == log10
    # No non-finite step: the count, 0, at the first step and the epoch's last.
    assert written("gradients/nonfinite_steps") == [(1, 0.0), (3, 0.0)]
    # A histogram of each step's one value: its buckets span exactly it.
    histograms = [
        tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors("dense_0/kernel/gradient")
    ]
    assert [(h[:, 0].min(), h[:, 1].max(), h[:, 2].sum()) for h in histograms] == [
        (15.0, 15.0, 1.0),
        (7.5, 7.5, 1.0),
        (3.75, 3.75, 1.0),
    ]
    assert monitor.events == []  # nothing non-finite, vanishing or exploding


def test_skipped_log_tells_the_skipped_steps_from_the_counts():
    log = _skipped.SkippedLog()
    log.begin_epoch()
    # Executions of 2 steps: 1-2 skipped one (which, the count does not
    # say), 3-4 and 5-6 both, 7-8 none; then a new epoch counts from 0.
    for previous, count in ((0, 1.0), (2, 3.0), (4, 5.0), (6, 5.0)):
        log.end_batch({"skipped_steps": count}, previous, previous + 2)
    assert log.new == 0.0
    assert [log.skipped(step) for step in range(1, 10)] == [
        None, None, True, True, True, True, False, False, False,
    ]  # fmt: skip
    assert log._runs == [(0, 2, 1.0), (2, 6, 4)]  # 3-4 and 5-6 as one
    log.begin_epoch()
    log.end_batch({"skipped_steps": 1.0}, 8, 9)
    assert (log.new, log.skipped(9)) == (1.0, True)
    log.forget(4)
    assert [log.skipped(step) for step in (2, 5, 9)] == [False, True, True]
    log.end_batch({"loss": 0.5}, 9, 10)  # a model that does not skip
    assert (log.new, log.skipped(10)) == (0.0, False)
