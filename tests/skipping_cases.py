"""`skip_bad_steps` cases shared by every backend.

`tests/test_skipping.py` runs them on every backend, in each compilation
mode (`conftest.MODES`).

The hand model: one bias-free Dense(1) with w = 3, y = 0, mse. A batch
x = [[p], [q]] gives loss = mean((w x)^2), so d/dw = w (p^2 + q^2): 15 for
(1, 2), 30 for (1, 3), 60 for (2, 4), 75 for (3, 4). With SGD(0.0) w stays
3, so these are every step's global gradient norms.
"""

import os
import warnings

import keras
import numpy as np
from conftest import LateBuilt
from conftest import X
from conftest import Y
from conftest import dense_0
from conftest import one_weight

import keras_keepgrad as kg

NAN_X = np.array([[np.nan], [2.0]], dtype="float32")


def _train_on_batch(model, *args, **kwargs):
    # Keras 3.15 resets the metrics at each `train_on_batch`; earlier
    # releases keep running values. Reset them here, so that each call logs
    # its own `skipped_steps` on every tested release.
    model.reset_metrics()
    return model.train_on_batch(*args, **kwargs)


def batch(p, q):
    return np.array([[p], [q]], dtype="float32")


def state_bytes(model):
    """Every weight and optimizer variable, as bytes (bit-identical or not)."""
    return [np.asarray(v).tobytes() for v in [*model.weights, *model.optimizer.variables]]


def kernel(model):
    """The kept gradient of the one weight (whatever its path)."""
    (grad,) = model.get_gradients_by_path().values()
    return grad


def one_step(model, x):
    """Fits one batch `x` (y = 0); returns its logs."""
    history = model.fit(x, np.zeros((2, 1), "float32"), batch_size=2, verbose=0)
    return {key: values[-1] for key, values in history.history.items()}


def iterations(model):
    return int(np.asarray(model.optimizer.iterations))


def nan_step_leaves_the_state_bit_identical(mode, model=None, sgd=keras.optimizers.SGD):
    """SGD(0.1, momentum=0.5): m1 = -0.1 * 15 = -1.5, w1 = 3 - 1.5 = 1.5;
    a NaN step changes nothing; then g = 5 * 1.5 = 7.5, m2 = 0.5 * -1.5 -
    0.75 = -1.5, w2 = 1.5 - 1.5 = 0. (`sgd`: the class, or a subclass.)"""
    model = model or one_weight(skip_bad_steps=True)
    model.compile(optimizer=sgd(0.1, momentum=0.5), loss="mse", **mode)
    logs = one_step(model, X)
    assert logs["skipped_steps"] == 0.0
    assert float(kernel(model)[0, 0]) == 15.0
    before = state_bytes(model)
    assert iterations(model) == 1
    logs = one_step(model, NAN_X)
    assert logs["skipped_steps"] == 1.0
    assert state_bytes(model) == before
    assert iterations(model) == 1
    # The skipped step's gradients are kept: the evidence.
    assert np.isnan(float(kernel(model)[0, 0]))
    one_step(model, X)
    assert float(kernel(model)[0, 0]) == 7.5
    assert float(np.asarray(model.weights[0])[0, 0]) == 0.0
    momentum = [v for v in model.optimizer.variables if "momentum" in v.path]
    assert [float(np.asarray(v)[0, 0]) for v in momentum] == [-1.5]
    assert iterations(model) == 2


def spike_above_the_factor_is_skipped_below_it_is_not(mode):
    """window 3, factor 3: three 15s fill the window (median 15, limit 45);
    60 is skipped and joins the window ([15, 15, 60]: median 15); 30 is
    applied ([15, 60, 30]: median 30, limit 90); 75 is applied ([60, 30,
    75]: median 60, limit 180); 60 is applied. (The metrics are reset
    before each `train_on_batch`: each call logs its own count.)"""
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=3.0, window=3))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    seen = []
    for p, q in [(1, 2), (1, 2), (1, 2), (2, 4), (1, 3), (3, 4), (2, 4)]:
        logs = _train_on_batch(model, batch(p, q), Y, return_dict=True)
        seen.append((float(kernel(model)[0, 0]), iterations(model), float(logs["skipped_steps"])))
    assert seen == [
        (15.0, 1, 0.0),
        (15.0, 2, 0.0),
        (15.0, 3, 0.0),
        (60.0, 3, 1.0),
        (30.0, 4, 0.0),
        (75.0, 5, 0.0),
        (60.0, 6, 0.0),
    ]


def finite_gradient_whose_square_overflows_is_not_skipped(mode):
    """x = [[2^33], [0]]: d/dw = 3 (2^66 + 0) = 3 * 2^66, about 2.2e20,
    finite in float32, but its square (about 4.9e40) is not: the non-finite
    check looks at the entries then, and the update runs (SGD(0.0): w
    stays 3, the iteration count goes to 1). A NaN step is still skipped."""
    model = one_weight(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    logs = _train_on_batch(model, batch(2.0**33, 0.0), Y, return_dict=True)
    assert float(kernel(model)[0, 0]) == 3.0 * 2.0**66
    assert (iterations(model), float(logs["skipped_steps"])) == (1, 0.0)
    logs = _train_on_batch(model, NAN_X, Y, return_dict=True)
    assert (iterations(model), float(logs["skipped_steps"])) == (1, 1.0)


def applied_update_that_overflows_a_weight_stays_applied(mode):
    """Skipping judges gradients, not the update they make: (1, 2) gives
    d/dw = 15, finite, and SGD(1e38) makes w = 3 - 1.5e39, beyond float32:
    -inf. That step is applied. The next one's gradient is 5 * -inf = -inf:
    skipped, and w stays -inf; so is every later step."""
    model = one_weight(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(1e38), loss="mse", **mode)
    logs = _train_on_batch(model, X, Y, return_dict=True)
    assert (float(kernel(model)[0, 0]), float(logs["skipped_steps"])) == (15.0, 0.0)
    assert float(model.get_weights()[0][0, 0]) == -np.inf
    for _ in range(2):
        logs = _train_on_batch(model, X, Y, return_dict=True)
        assert float(kernel(model)[0, 0]) == -np.inf
        assert (iterations(model), float(logs["skipped_steps"])) == (1, 1.0)
        assert float(logs["loss"]) == np.inf
    assert float(model.get_weights()[0][0, 0]) == -np.inf


def history_counts_the_skipped_steps_per_epoch(mode):
    """Each epoch: (1, 2) three times, (2, 4), NaN, (1, 3); window 3,
    factor 3. Epoch 1: 60 is skipped (limit 45), NaN is skipped (and joins
    no window), 30 is applied: 2. Epoch 2 starts from [15, 60, 30]: the
    15s are applied and fill it with 15 again, so 60 is skipped again, NaN
    too, 30 not: 2. 8 updates in all."""
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=3.0, window=3))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    x = np.concatenate([batch(1, 2)] * 3 + [batch(2, 4), NAN_X, batch(1, 3)])
    history = model.fit(
        x,
        np.zeros((12, 1), "float32"),
        batch_size=2,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(X, Y),
    )
    assert history.history["skipped_steps"] == [2.0, 2.0]
    # Evaluation logs no count of its own.
    assert sorted(history.history) == ["loss", "skipped_steps", "val_loss"]
    assert iterations(model) == 8
    assert "skipped_steps" not in model.evaluate(X, Y, verbose=0, return_dict=True)


def own_train_step_is_guarded(mode):
    """A user's `train_step` (mse, `optimizer.apply`): the NaN step is skipped."""
    model = LateBuilt(own_step=True, skip_bad_steps=True)
    nan_step_leaves_the_state_bit_identical(mode, model)


def off_changes_nothing(mode):
    """Off: no metric, no log key; on then off again: the same."""
    model = one_weight(skip_bad_steps=True)
    model.skip_bad_steps = None
    assert model.skip_bad_steps is None
    plain = one_weight()
    for m in (model, plain):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
        logs = _train_on_batch(m, NAN_X, Y, return_dict=True)
        assert sorted(logs) == ["loss"]
        # Not skipped: the NaN reached the weight.
        assert np.isnan(float(np.asarray(m.weights[0])[0, 0]))
    assert len(model.metrics) == len(plain.metrics) == 1  # the loss's
    model.skip_bad_steps = kg.SkipBadSteps()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    assert float(_train_on_batch(model, NAN_X, Y, return_dict=True)["skipped_steps"]) == 1.0


def under_loss_scaling(mode):
    """mixed_float16, `LossScaleOptimizer(SGD(0.1), initial_scale=2)`: the
    update receives 30 / 2 = 15, w1 = 1.5. A NaN step is handed to the loss
    scale optimizer, which skips the update and halves its scale (2 -> 1):
    the weights and the inner optimizer's variables stay bit-identical. A
    spike is not handed to it: its scale and counter stay too (window 1,
    factor 1.5: after 15, w = 1.5 and (2, 4) give 1.5 * 20 = 30 > 22.5)."""
    keras.config.set_dtype_policy("mixed_float16")
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=1.5, window=1))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0)
    model.compile(optimizer=optimizer, loss="mse", **mode)
    _train_on_batch(model, X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(np.asarray(model.weights[0])[0, 0]) == 1.5
    inner = [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables]
    weights = [np.asarray(v).tobytes() for v in model.weights]
    logs = _train_on_batch(model, NAN_X, Y, return_dict=True)
    assert float(logs["skipped_steps"]) == 1.0
    assert [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables] == inner
    assert [np.asarray(v).tobytes() for v in model.weights] == weights
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    counter = float(np.asarray(optimizer.step_counter))
    logs = _train_on_batch(model, batch(2, 4), Y, return_dict=True)
    assert float(kernel(model)[0, 0]) == 30.0
    assert float(logs["skipped_steps"]) == 1.0
    assert [np.asarray(v).tobytes() for v in model.weights] == weights
    assert [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables] == inner
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    assert float(np.asarray(optimizer.step_counter)) == counter


# Saved batches (`save_batches_to`) --------------------------------------


def monitored(model, batches, callbacks, **fit_kwargs):
    """Fits `batches` (y = 0) in order; returns the monitor's warnings."""
    x = np.concatenate(batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x, np.zeros_like(x), batch_size=2, shuffle=False, verbose=0,
            callbacks=callbacks, **fit_kwargs,
        )  # fmt: skip
    # Backends warn of their own things too (PyTorch of NumPy's `copy`).
    return [str(w.message) for w in caught if str(w.message).startswith("GradientMonitor")]


def events(monitor):
    return [(e["kind"], e["step"], e["since"], e.get("until")) for e in monitor.events]


SKIPPED_NAN = (
    "skip_bad_steps skipped the update: non-finite gradients (NaN or inf) in 1 of 1 "
    "layers, in forward order: 'dense_0'. The weights and the optimizer's state are "
    "as they were before the step."
)


def monitor_reports_a_skipped_nan_step_as_skipped(mode):
    """Batches X, NaN, X, X; SGD(0.0) counts an update without moving w.
    The NaN step is skipped: a "skipped" state at step 2, only warned
    about although `action="stop"`; steps 3 and 4 end it (recovery_steps
    2). All four steps ran, three updates. `GradientReport` counts the
    step as read and skipped; its NaN still makes the verdict."""
    model = one_weight(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    monitor = kg.callbacks.GradientMonitor(action="stop", recovery_steps=2)
    report = kg.callbacks.GradientReport(print_table=False)
    messages = monitored(model, [X, NAN_X, X, X], [monitor, report])
    assert iterations(model) == 3
    assert events(monitor) == [("skipped", 2, 2, None), ("skipped_ended", 4, 2, 2)]
    assert monitor.events[0]["layers"] == ["dense_0"] and monitor.events[0]["epoch"] == 0
    assert messages == [
        f"GradientMonitor: Step 2: {SKIPPED_NAN}",
        "GradientMonitor: Step 4: no step read was skipped for 2 checks in a row: the "
        "state lasted steps 2-2 (1 check).",
        "GradientMonitor: summary of steps 1-4:\n'dense_0' skipped: steps 2-2 (1 check)",
    ]
    (row,) = report.rows
    assert (row["steps"], row["nonfinite"], row["verdict"]) == (4, 1, "non-finite")
    assert report.skipped_steps == 1
    assert report._subtitle().startswith("4 training steps read (1 skipped), backend")


def monitor_reports_a_skipped_spike_as_skipped_not_exploding(mode):
    """window 3, factor 3: 60 after three 15s is skipped. Above
    exploding_threshold=50 it would raise; skipped, it is a warning, with
    the largest layer norms, and step 5 (recovery_steps=1) ends it."""
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=3.0, window=3))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    monitor = kg.callbacks.GradientMonitor(
        action="raise", exploding_threshold=50.0, recovery_steps=1
    )
    messages = monitored(model, [X, X, X, batch(2, 4), X], [monitor])
    assert iterations(model) == 4
    assert events(monitor) == [("skipped", 4, 4, None), ("skipped_ended", 5, 4, 4)]
    assert messages == [
        "GradientMonitor: Step 4: skip_bad_steps skipped the update: global norm 60; "
        "largest layer norms: 'dense_0' (60). The weights and the optimizer's state are "
        "as they were before the step.",
        "GradientMonitor: Step 5: no step read was skipped for 1 checks in a row: the "
        "state lasted steps 4-4 (1 check).",
    ]  # `action="raise"`: no summary


def monitor_reports_a_nan_the_skip_let_through_as_nonfinite(mode):
    """Spikes only (`nonfinite=False`): the NaN step is applied, w turns
    NaN, and the monitor stops `fit` at step 2 as without skipping."""
    config = kg.SkipBadSteps(nonfinite=False, spike_factor=3.0, window=3)
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    monitor = kg.callbacks.GradientMonitor(action="stop")
    messages = monitored(model, [X, NAN_X, X], [monitor])
    assert iterations(model) == 2
    assert np.isnan(float(np.asarray(model.weights[0])[0, 0]))
    assert events(monitor) == [("nonfinite", 2, 2, None)]
    assert messages == [
        "GradientMonitor: Step 2: non-finite gradients (NaN or inf) in 1 of 1 layers, in "
        "forward order: 'dense_0'. Stopping training.",
        "GradientMonitor: summary of steps 1-2:\n'dense_0' non-finite: steps 2-2 (1 check), "
        "until the end",
    ]


def monitor_knows_a_kept_step_skipped_before_its_check(mode):
    """keep_every=2 keeps steps 1, 3, 5; check_freq=2 checks at steps 2,
    4, 6 and reads them there. Step 3 (NaN) was skipped, a batch before
    the check that reads it: reported at step 3; step 5 ends it."""
    model = one_weight(keep_every=2, skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    monitor = kg.callbacks.GradientMonitor(check_freq=2, recovery_steps=1)
    messages = monitored(model, [X, X, NAN_X, X, X, X], [monitor])
    assert iterations(model) == 5
    assert events(monitor) == [("skipped", 3, 3, None), ("skipped_ended", 5, 3, 3)]
    assert messages[0] == f"GradientMonitor: Step 3: {SKIPPED_NAN}"
    assert len(messages) == 3  # the begin, the end, the summary


def saved(directory):
    """`{file name: {key: array}}` of the saved batches in `directory`."""
    files = {}
    for name in sorted(os.listdir(directory)):
        with np.load(os.path.join(directory, name)) as f:
            files[name] = {key: f[key] for key in f.files}
    return files


def nan_batch_is_saved_with_its_gradients(mode, tmp_path):
    """Batches (1, 2), (NaN, 2), (1, 2), sample weights 1, (2, 1), 1: the
    second step is skipped and its file holds exactly what the step
    received, its number (2), its kept gradient (NaN), that it was skipped
    and that its one replica (0) went bad; no loss scale without a
    `LossScaleOptimizer`. Good steps leave no file."""
    directory = str(tmp_path / "bad")
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=directory))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    x = np.concatenate([X, NAN_X, X])
    weights = np.array([1.0, 1.0, 2.0, 1.0, 1.0, 1.0], "float32")
    history = model.fit(
        x,
        np.zeros((6, 1), "float32"),
        sample_weight=weights,
        batch_size=2,
        shuffle=False,
        verbose=0,
    )
    assert history.history["skipped_steps"] == [1.0]
    files = saved(directory)
    assert list(files) == ["bad_step_00000002.npz"]
    arrays = files["bad_step_00000002.npz"]
    assert sorted(arrays) == [
        "first_bad_replica",
        "grad/dense_0/kernel",
        "sample_weight",
        "skipped",
        "step",
        "x",
        "y",
    ]
    assert arrays["skipped"].dtype == np.bool_ and bool(arrays["skipped"])
    assert int(arrays["first_bad_replica"]) == 0
    np.testing.assert_array_equal(arrays["x"], NAN_X)
    assert arrays["x"].dtype == np.float32
    np.testing.assert_array_equal(arrays["y"], np.zeros((2, 1)))
    np.testing.assert_array_equal(arrays["sample_weight"], [2.0, 1.0])
    assert int(arrays["step"]) == 2
    assert arrays["grad/dense_0/kernel"].shape == (1, 1)
    assert np.isnan(arrays["grad/dense_0/kernel"][0, 0])


def spike_batch_is_saved_and_replays_to_its_gradients(mode, tmp_path):
    """SGD(0.1), window 1, factor 1.5: step 1 ((1, 2): 15) gives w = 1.5;
    step 2 ((2, 4): 1.5 * 20 = 30 > 1.5 * 15) is skipped and saved.
    Replayed on a model restored from the weights saved before step 2
    (w = 1.5), and on the trained model itself (still 1.5), the batch
    gives 30 again; replaying changes no weight."""
    directory = str(tmp_path / "bad")
    config = kg.SkipBadSteps(spike_factor=1.5, window=1, save_batches_to=directory)
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    _train_on_batch(model, X, Y)
    checkpoint = str(tmp_path / "before.weights.h5")
    model.save_weights(checkpoint)
    logs = _train_on_batch(model, batch(2, 4), Y, return_dict=True)
    assert float(logs["skipped_steps"]) == 1.0
    _train_on_batch(model, X, Y)  # 1.5 * 5 = 7.5: applied, not saved
    files = saved(directory)
    assert list(files) == ["bad_step_00000002.npz"]
    arrays = files["bad_step_00000002.npz"]
    assert sorted(arrays) == [
        "first_bad_replica",
        "grad/dense_0/kernel",
        "skipped",
        "step",
        "x",
        "y",
    ]
    np.testing.assert_array_equal(arrays["x"], batch(2, 4))
    assert int(arrays["step"]) == 2
    # A finite spike: skipped, and no replica's gradients were non-finite.
    assert bool(arrays["skipped"]) and int(arrays["first_bad_replica"]) == -1
    np.testing.assert_array_equal(arrays["grad/dense_0/kernel"], [[30.0]])

    restored = one_weight(skip_bad_steps=config)
    restored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    restored.load_weights(checkpoint)
    path = os.path.join(directory, "bad_step_00000002.npz")
    replayed = kg.replay_batch(restored, path)
    assert list(replayed) == ["dense_0/kernel"]
    np.testing.assert_array_equal(replayed["dense_0/kernel"], arrays["grad/dense_0/kernel"])
    assert float(np.asarray(restored.weights[0])[0, 0]) == 1.5
    # The trained model: 7.5 moved it to 1.5 - 0.75 = 0.75, so 0.75 * 20.
    np.testing.assert_array_equal(kg.replay_batch(model, path)["dense_0/kernel"], [[15.0]])
    assert float(np.asarray(model.weights[0])[0, 0]) == 0.75


def saved_files_stop_at_max_saved(mode, tmp_path):
    """max_saved=2, NaN batches (NaN, 1) .. (NaN, 4): steps 1 and 2 are
    saved (the first are kept), 3 and 4 not; a later `fit` into the same
    directory, with another model, saves nothing either."""
    directory = str(tmp_path / "bad")
    config = kg.SkipBadSteps(save_batches_to=directory, max_saved=2)
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    x = np.array([[np.nan], [1], [np.nan], [2], [np.nan], [3], [np.nan], [4]], "float32")
    history = model.fit(x, np.zeros((8, 1), "float32"), batch_size=2, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [4.0]
    files = saved(directory)
    assert list(files) == ["bad_step_00000001.npz", "bad_step_00000002.npz"]
    assert [float(f["x"][1, 0]) for f in files.values()] == [1.0, 2.0]
    other = one_weight(skip_bad_steps=config)
    other.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    other.fit(NAN_X, Y, verbose=0)
    assert list(saved(directory)) == list(files)


def an_earlier_runs_file_of_the_same_name_is_kept(mode, tmp_path):
    """Two model objects, one directory: each counts its steps from 1, and
    each skips its step 1, batch (NaN, 1), then (NaN, 2). The first file
    stays as written; the second gets the next free name."""
    directory = str(tmp_path / "bad")
    for second in (1.0, 2.0):
        model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=directory))
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
        model.fit(np.array([[np.nan], [second]], "float32"), Y, shuffle=False, verbose=0)
    files = saved(directory)
    assert list(files) == ["bad_step_00000001.npz", "bad_step_00000001_2.npz"]
    assert [(int(f["step"]), float(f["x"][1, 0])) for f in files.values()] == [(1, 1.0), (1, 2.0)]


def saving_adds_one_counter_and_off_adds_none(mode, tmp_path):
    """Skipping alone: 5 state variables; with saving, the step counter
    too; set off again, it is gone."""
    plain = one_weight(skip_bad_steps=True)
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=str(tmp_path)))
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
        m.fit(X, Y, verbose=0)
    assert len(model.metrics_variables) == len(plain.metrics_variables) + 1
    model.skip_bad_steps = True
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    model.fit(NAN_X, Y, verbose=0)
    assert len(model.metrics_variables) == len(plain.metrics_variables)
    assert os.listdir(tmp_path) == []


def saved_loss_scale_is_the_steps(mode, tmp_path):
    """mixed_float16, `LossScaleOptimizer(initial_scale=2)`: a NaN step is
    saved with the scale it ran under (2), though it halves it to 1."""
    keras.config.set_dtype_policy("mixed_float16")
    directory = str(tmp_path / "bad")
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=directory))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0)
    model.compile(optimizer=optimizer, loss="mse", **mode)
    _train_on_batch(model, NAN_X, Y)
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    (arrays,) = saved(directory).values()
    assert float(arrays["loss_scale"]) == 2.0
    assert int(arrays["step"]) == 1


def dict_inputs_are_saved_per_key_and_replayed(mode, tmp_path):
    """Inputs `{"a": x}`, SGD(0.0), window 1, factor 1.5: (1, 2) gives 15;
    (2, 4) gives 60 > 22.5, skipped and saved as `x/a`; (NaN, 2) too.
    Replayed (w = 3 still), the spike's file gives 60 again."""
    directory = str(tmp_path / "bad")
    inputs = {"a": keras.Input((1,), name="a")}
    config = kg.SkipBadSteps(spike_factor=1.5, window=1, save_batches_to=directory)
    model = kg.KeepGradModel(inputs, dense_0()(inputs["a"]), skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    x = np.concatenate([X, batch(2, 4), NAN_X])
    history = model.fit(
        {"a": x}, np.zeros((6, 1), "float32"), batch_size=2, shuffle=False, verbose=0
    )
    assert history.history["skipped_steps"] == [2.0]
    files = saved(directory)
    assert list(files) == ["bad_step_00000002.npz", "bad_step_00000003.npz"]
    spike, nan = files.values()
    assert sorted(spike) == [
        "first_bad_replica",
        "grad/dense_0/kernel",
        "skipped",
        "step",
        "x/a",
        "y",
    ]
    np.testing.assert_array_equal(spike["x/a"], batch(2, 4))
    np.testing.assert_array_equal(spike["grad/dense_0/kernel"], [[60.0]])
    np.testing.assert_array_equal(nan["x/a"], NAN_X)
    path = os.path.join(directory, "bad_step_00000002.npz")
    assert kg.replay_batch(model, path) == {"dense_0/kernel": np.array([[60.0]], "float32")}


# Flagged, not skipped (`SkipBadSteps(skip=False)`) ------------------------


def flagged_steps_are_applied_counted_and_saved(mode, tmp_path):
    """skip=False, SGD(0.1), window 1, factor 1.5. Step 1 ((1, 2): 15):
    w = 3 - 1.5 = 1.5. Step 2 ((2, 4): 1.5 * 20 = 30 > 1.5 * 15) is
    flagged, saved and applied: w = 1.5 - 3 = -1.5. Step 3 ((1, 2):
    -1.5 * 5 = -7.5, norm 7.5 < 1.5 * 30): applied, w = -0.75, no file.
    Step 4 ((NaN, 2)) is flagged, saved and applied: w turns NaN. Two
    flagged, logged as `flagged_steps`, never as `skipped_steps`; four
    updates."""
    directory = str(tmp_path / "bad")
    config = kg.SkipBadSteps(spike_factor=1.5, window=1, save_batches_to=directory, skip=False)
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    weights = []
    for x in (X, batch(2, 4), X):
        logs = _train_on_batch(model, x, Y, return_dict=True)
        weights.append(float(np.asarray(model.weights[0])[0, 0]))
    assert weights == [1.5, -1.5, -0.75]
    assert "skipped_steps" not in logs
    history = model.fit(NAN_X, Y, batch_size=2, shuffle=False, verbose=0)
    assert sorted(history.history) == ["flagged_steps", "loss"]
    assert history.history["flagged_steps"] == [1.0]
    assert np.isnan(float(np.asarray(model.weights[0])[0, 0]))
    assert iterations(model) == 4
    files = saved(directory)
    assert list(files) == ["bad_step_00000002.npz", "bad_step_00000004.npz"]
    spike, nan = files.values()
    np.testing.assert_array_equal(spike["grad/dense_0/kernel"], [[30.0]])
    np.testing.assert_array_equal(spike["x"], batch(2, 4))
    assert [bool(spike["skipped"]), int(spike["first_bad_replica"])] == [False, -1]
    np.testing.assert_array_equal(nan["x"], NAN_X)
    assert np.isnan(nan["grad/dense_0/kernel"][0, 0])
    assert [bool(nan["skipped"]), int(nan["first_bad_replica"])] == [False, 0]


def flagged_counts_per_epoch_like_skipped(mode):
    """skip=False, SGD(0.0), per epoch (1, 2), (NaN, 2), (1, 2), (NaN, 2).
    The NaN step is flagged and applied: w - 0.0 * NaN is NaN, so every
    later step is flagged too: 3 in the first epoch (the count starts
    again), 4 in the second; 8 updates. Skipped, it would be [2, 2]."""
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(skip=False))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    x = np.concatenate([X, NAN_X, X, NAN_X])
    history = model.fit(
        x, np.zeros((8, 1), "float32"), batch_size=2, epochs=2, shuffle=False, verbose=0
    )
    assert history.history["flagged_steps"] == [3.0, 4.0]
    assert "skipped_steps" not in history.history
    assert iterations(model) == 8


def flagged_under_loss_scaling_is_skipped_by_the_optimizer(mode, tmp_path):
    """skip=False, mixed_float16, `LossScaleOptimizer(SGD(0.1),
    initial_scale=2)`: a NaN step is flagged, and the loss scale optimizer
    skips it itself (scale 2 -> 1, w stays 3): its file says skipped."""
    keras.config.set_dtype_policy("mixed_float16")
    directory = str(tmp_path / "bad")
    config = kg.SkipBadSteps(save_batches_to=directory, skip=False)
    model = one_weight(skip_bad_steps=config)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0)
    model.compile(optimizer=optimizer, loss="mse", **mode)
    logs = _train_on_batch(model, NAN_X, Y, return_dict=True)
    assert float(logs["flagged_steps"]) == 1.0
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    assert float(np.asarray(model.weights[0])[0, 0]) == 3.0
    (arrays,) = saved(directory).values()
    assert [bool(arrays["skipped"]), int(arrays["first_bad_replica"])] == [True, 0]
    assert float(arrays["loss_scale"]) == 2.0
