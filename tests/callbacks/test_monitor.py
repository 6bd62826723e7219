"""Tests for keras_keepgrad.callbacks.monitor: GradientMonitor.

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import warnings

import keras
import numpy as np
import pytest
from callback_helpers import hand_data
from callback_helpers import hand_model
from callback_helpers import two_layer_model
from conftest import without_numpy_array_warnings
from report_cases import monitor_messages

import keras_keepgrad as kg
from keras_keepgrad import callbacks


def sqrt_model():
    """a -> sqrt -> b: at x = 0, only layer `a` gets a NaN gradient.

    d sqrt(z)/dz = 1 / (2 sqrt(0)) = inf, times x = 0 -> NaN for a's
    kernel; b's kernel gets sqrt(0) * dL/dout = 0.
    """
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="a")(inputs)
    hidden = keras.layers.Lambda(keras.ops.sqrt, name="root")(hidden)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="b")(hidden)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_monitor_stops_a_nan_run_and_names_the_layer():
    model = sqrt_model()
    x = np.array([[1.0], [4.0], [0.0], [0.0], [1.0], [1.0]])
    monitor = callbacks.GradientMonitor(action="stop")
    # The report, then the summary of the run at its (early) end.
    with (
        pytest.warns(UserWarning, match=r"summary of steps 1-2:\n'a' non-finite: steps 2-2"),
        pytest.warns(UserWarning, match=r"Step 2: non-finite .* 1 of 2 layers.*'a'\. Stopping"),
    ):
        history = model.fit(
            x, np.ones_like(x), batch_size=2, shuffle=False, verbose=0, callbacks=[monitor]
        )
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2  # batch 3 never ran
    assert len(history.history["loss"]) == 1
    (event,) = monitor.events
    assert (event["kind"], event["step"], event["layers"]) == ("nonfinite", 2, ["a"])


def test_monitor_lists_nonfinite_layers_in_forward_order():
    model = two_layer_model(names=("z_first", "a_second"))
    x = np.array([[np.nan, 1.0]])
    monitor = callbacks.GradientMonitor(action="warn")
    with pytest.warns(UserWarning, match=r"'z_first', 'a_second'") as recorded:
        model.fit(x, np.ones((1, 1)), verbose=0, callbacks=[monitor])
    caught = without_numpy_array_warnings(recorded)
    assert monitor.events[0]["layers"] == ["z_first", "a_second"]
    # The report, then the run's summary.
    assert "summary of steps 1-1" in str(caught[1].message) and len(caught) == 2


def test_monitor_names_the_first_layer_of_a_skipped_step_and_does_not_stop():
    # As above, with `skip_bad_steps`: the NaN step 2 (only in 'a') is
    # skipped, so `fit` goes on to step 3 from the weights of step 1.
    model = sqrt_model()
    model.skip_bad_steps = True
    x = np.array([[1.0], [4.0], [0.0], [0.0], [1.0], [1.0]])
    monitor = callbacks.GradientMonitor(action="stop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, np.ones_like(x), batch_size=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2  # steps 1 and 3
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [("skipped", 2, ["a"])]
    assert monitor_messages(caught) == [
        "GradientMonitor: Step 2: skip_bad_steps skipped the update: non-finite gradients "
        "(NaN or inf) in 1 of 2 layers, in forward order: 'a'. The weights and the "
        "optimizer's state are as they were before the step.",
        "GradientMonitor: summary of steps 1-3:\n'a' skipped: steps 2-2 (1 check), until the end",
    ]


@pytest.mark.backends(
    "tensorflow", "jax", reason="Keras's PyTorch trainer refuses steps_per_execution > 1"
)
def test_monitor_tells_skipped_steps_under_steps_per_execution():
    # Executions of 2 steps; the monitor checks their last: steps 2, 4, 6, 8.
    # Steps 2, 3, 4 are NaN and skipped. Execution 1 skipped 1 of its 2
    # steps, which the log does not name: step 2 is NaN, and
    # `skip_bad_steps` skips NaN steps, so it was. Execution 2 skipped both.
    # Steps 6 and 8 end the state (recovery_steps=2).
    model = hand_model(lr=0.0, steps_per_execution=2)
    model.skip_bad_steps = True
    x, y = hand_data(8)
    x[2:8] = np.nan
    monitor = callbacks.GradientMonitor(action="raise", recovery_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 5
    assert [(e["kind"], e["step"], e["since"], e.get("until")) for e in monitor.events] == [
        ("skipped", 2, 2, None),
        ("skipped_ended", 8, 2, 4),
    ]
    assert monitor.states[0]["checks"] == 2
    assert len(monitor_messages(caught)) == 2  # `action="raise"`: no summary


def test_monitor_under_loss_scaling_counts_nan_as_before_with_skip_bad_steps():
    # The test below, with `skip_bad_steps`: the optimizer skips NaN steps
    # itself, and they count once its scale fell below min_loss_scale.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    model = hand_model(optimizer=optimizer)
    model.skip_bad_steps = True
    x, y = hand_data(5)
    y[:] = np.nan
    monitor = callbacks.GradientMonitor(action="raise")
    with pytest.raises(RuntimeError, match=r"Step 3: non-finite .*'dense_0'.*fell to 0\.5"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert [e["kind"] for e in monitor.events] == ["nonfinite"]


def test_monitor_waits_for_the_loss_scale_then_raises():
    # Every batch is NaN. Scale 4 -> 2 -> 1 -> 0.5: only the third skipped
    # step leaves the scale below min_loss_scale=1.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    model = hand_model(optimizer=optimizer)
    x, y = hand_data(5)
    y[:] = np.nan
    monitor = callbacks.GradientMonitor(action="raise")
    with pytest.raises(RuntimeError, match=r"Step 3: .*'dense_0'.*fell to 0\.5"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == 0.5
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0


def test_monitor_reports_vanishing_layer_after_n_steps():
    # b's kernel is 0, so a's gradient (through b) is 0; lr 0 keeps it so.
    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="a")(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="b")(hidden)
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = np.ones((4, 1))
    monitor = callbacks.GradientMonitor(vanishing_threshold=1e-6, vanishing_steps=3)
    with (
        pytest.warns(UserWarning, match=r"'a' vanishing: steps 1-4 \(4 checks\), until the end"),
        pytest.warns(UserWarning, match=r"Step 3: vanishing gradients: .*'a' \(0\).*3 checks"),
    ):
        model.fit(x, np.ones_like(x), batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert [(e["kind"], e["step"], e["layers"]) for e in monitor.events] == [
        ("vanishing", 3, ["a"])
    ]


def test_monitor_reports_explosions_by_threshold_and_by_median():
    # lr 0 keeps w = 3; batch k is c * [[1], [2]] so the gradient is 15 c^2:
    # 15 for 11 batches, then 1500 (c = 10).
    model = hand_model(lr=0.0)
    x, y = hand_data(12)
    x[22:] *= 10.0
    by_threshold = callbacks.GradientMonitor(exploding_threshold=100.0)
    by_median = callbacks.GradientMonitor(
        exploding_threshold=None, exploding_factor=10.0, median_window=50
    )
    with pytest.warns(UserWarning) as recorded:
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[by_threshold, by_median])
    caught = without_numpy_array_warnings(recorded)
    # Each reports the explosion, then sums the run up at its end.
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4
    assert "summary of steps 1-12:\n'dense_0' exploding: steps 12-12 (1 check)" in messages[2]
    assert (
        "Step 12: exploding gradients: global norm 1500 is above exploding_threshold=100"
        in messages[0]
    )
    assert "exploding_factor=10 times the median of the last 11 (15)" in messages[1]
    assert "'dense_0' (1500)" in messages[1]
    for monitor in (by_threshold, by_median):
        assert [(e["kind"], e["step"]) for e in monitor.events] == [("exploding", 12)]
