"""`model.first_bad_replica` on JAX: one device, and `DataParallel`.

Under `keras.distribution.DataParallel` the devices' partial gradients are
summed inside XLA's compiled gradient and never exist apart: a finite
step had no bad device (None, exact); a non-finite one replays each
device's rows alone, with Keras's own step. `skip_bad_steps` judges the
global gradient there, as on one device.
"""

import os
import warnings

import jax
import keras
import numpy as np
import pytest
from conftest import LateBuilt
from conftest import X
from conftest import Y
from conftest import one_weight

import keras_keepgrad as kg

needs_two_devices = pytest.mark.skipif(
    len(jax.devices("cpu")) < 2,
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2",
)
NAN_ON_1 = np.array([[1.0], [np.nan]], "float32")


def test_one_device_names_device_0(mode):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    model.train_on_batch(X, Y)
    assert model.first_bad_replica is None
    model.train_on_batch(NAN_ON_1, Y)
    assert model.first_bad_replica == 0


def data_parallel():
    return keras.distribution.DataParallel(devices=jax.devices("cpu")[:2])


@needs_two_devices
def test_data_parallel_names_the_device_whose_rows_went_bad(tmp_path):
    """w = 3, (1, 2): 15, SGD(0.1): w = 1.5, no bad device. Then (1, NaN),
    the NaN in device 1's half: skipped (w stays 1.5), saved, and device 1
    is named, in the saved file too; the monitor says so."""
    directory = str(tmp_path / "bad")
    with data_parallel().scope():
        model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=directory))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, shuffle=False, verbose=0)
        assert model.first_bad_replica is None
        monitor = kg.callbacks.GradientMonitor()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = model.fit(
                NAN_ON_1, Y, batch_size=2, shuffle=False, verbose=0, callbacks=[monitor]
            )
        assert history.history["skipped_steps"] == [1.0]
        assert float(np.asarray(model.weights[0])[0, 0]) == 1.5
        assert model.first_bad_replica == 1
    assert [event["message"] for event in monitor.events] == [
        "Step 1: skip_bad_steps skipped the update: non-finite gradients (NaN "
        "or inf) in 1 of 1 layers, in forward order: 'dense_0', first on "
        "replica 1 of 2. The weights and the optimizer's state are as they "
        "were before the step."
    ]
    (name,) = os.listdir(directory)
    with np.load(os.path.join(directory, name)) as saved:
        assert bool(saved["skipped"]) and int(saved["step"]) == 2
        assert int(saved["first_bad_replica"]) == 1


@needs_two_devices
@pytest.mark.parametrize(
    ("rows", "first"),
    [
        ([1.0, 2.0, 3.0, 4.0], None),
        ([np.nan, 2.0, 3.0, 4.0], 0),
        ([1.0, 2.0, 3.0, np.nan], 1),
        ([1.0, np.nan, np.inf, 4.0], 0),
        ([1.0, 2.0, np.inf, 4.0], 1),
    ],
)
def test_data_parallel_names_the_first_bad_device(rows, first):
    """4 rows over 2 devices: device 0 holds rows 0 and 1, device 1 rows 2
    and 3. A NaN or an infinity in a device's rows makes its gradient
    (w * x^2) non-finite; a clean batch names none. Flagged, not skipped,
    with SGD(0.1): the update runs and turns w non-finite, so a replay
    from the weights after the step, not before it, would name device 0
    every time."""
    x = np.array(rows, "float32")[:, None]
    with data_parallel().scope():
        model = one_weight(skip_bad_steps=kg.SkipBadSteps(skip=False))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(x, np.zeros_like(x), batch_size=4, shuffle=False, verbose=0)
        assert history.history["flagged_steps"] == [0.0 if first is None else 1.0]
        assert model.first_bad_replica == first


@needs_two_devices
def test_data_parallel_replays_each_device_alone_with_batch_normalization():
    """A BatchNormalization in training takes its statistics over the
    global batch, so a NaN in device 1's rows reaches every row; each
    device's rows replayed alone name device 1, whose rows hold it."""
    with data_parallel().scope():
        inputs = keras.Input((1,))
        hidden = keras.layers.BatchNormalization(name="norm")(inputs)
        model = kg.KeepGradModel(
            inputs,
            keras.layers.Dense(1, name="dense_0")(hidden),
            skip_bad_steps=kg.SkipBadSteps(skip=False),
        )
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        x = np.array([[1.0], [2.0], [3.0], [np.nan]], "float32")
        model.fit(x, np.zeros_like(x), batch_size=4, shuffle=False, verbose=0)
        assert not np.isfinite(np.asarray(model.gradients["dense_0"]["kernel"])).all()
        assert model.first_bad_replica == 1


@needs_two_devices
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: one_weight(), r"set `skip_bad_steps`"),
        (lambda: LateBuilt(own_step=True, skip_bad_steps=True), r"this model has its own"),
    ],
    ids=["not_judged", "own_step"],
)
def test_data_parallel_without_a_replay_says_why(make, reason):
    """No replay without `skip_bad_steps` (it costs a copy of the weights
    per step), nor with a `train_step` of the user's own (its loss cannot
    be recomputed): a finite step still reads None, a non-finite one
    raises saying why."""
    with data_parallel().scope():
        model = make()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        model.fit(X, Y, batch_size=2, shuffle=False, verbose=0)
        assert model.first_bad_replica is None
        model.fit(NAN_ON_1, Y, batch_size=2, shuffle=False, verbose=0)
        with pytest.raises(RuntimeError, match=reason):
            model.first_bad_replica  # noqa: B018


@needs_two_devices
def test_data_parallel_trains_a_model_that_cannot_run_on_fewer_rows():
    """A stateful LSTM takes batches of exactly 4 rows: it cannot replay
    one device's 2. It trains as in plain Keras, and a non-finite step
    says why its device is not named."""
    with data_parallel().scope():
        inputs = keras.Input((3, 2), batch_size=4)
        outputs = keras.layers.Dense(1)(keras.layers.LSTM(3, stateful=True)(inputs))
        model = kg.KeepGradModel(inputs, outputs, skip_bad_steps=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        x = np.ones((4, 3, 2), "float32")
        history = model.fit(x, np.zeros((4, 1), "float32"), batch_size=4, verbose=0)
        assert history.history["skipped_steps"] == [0.0]
        x[3, 0, 0] = np.nan
        history = model.fit(x, np.zeros((4, 1), "float32"), batch_size=4, verbose=0)
        assert history.history["skipped_steps"] == [1.0]
        with pytest.raises(RuntimeError, match=r"could not run on one device's rows"):
            model.first_bad_replica  # noqa: B018


@needs_two_devices
def test_data_parallel_replays_each_device_at_the_steps_loss_scale():
    """float16 compute, `LossScaleOptimizer` at 1024, w = 3, rows (1, 1 |
    8, 8): the scaled kernel gradient 1024 * 6 * (1 + 1 + 64 + 64) / 4 =
    199680 overflows float16 (65504); so does device 1's share, 1024 * 6 *
    128 / 4 = 196608, not device 0's, 3072. Unscaled, every share is
    finite (192 at most). The scale halves to 512; rows (8, 8 | 1, 1) then
    overflow on device 0 (98304)."""
    with data_parallel().scope():
        model = one_weight(dtype="mixed_float16", skip_bad_steps=kg.SkipBadSteps(skip=False))
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), initial_scale=1024.0
        )
        model.compile(optimizer=optimizer, loss="mse")
        firsts = []
        for rows in ([1.0, 1.0, 8.0, 8.0], [8.0, 8.0, 1.0, 1.0]):
            x = np.array(rows, "float32")[:, None]
            model.fit(x, np.zeros_like(x), batch_size=4, shuffle=False, verbose=0)
            assert np.isinf(np.asarray(model.gradients["dense_0"]["kernel"])[0, 0])
            firsts.append((model.first_bad_replica, float(optimizer.dynamic_scale)))
    assert firsts == [(1, 512.0), (0, 256.0)]
