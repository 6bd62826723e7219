"""`model.first_bad_replica` on JAX: one device, and `DataParallel`.

Under `keras.distribution.DataParallel` the devices' partial gradients are
summed inside XLA's compiled gradient and never exist apart: a finite
step had no bad device (None, exact), a non-finite one cannot be traced
to one, and reading it raises rather than guess. `skip_bad_steps` judges
the global gradient there, as on one device.
"""

import os

import jax
import keras
import numpy as np
import pytest
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


@needs_two_devices
def test_data_parallel_never_guesses_the_device(tmp_path):
    """w = 3, (1, 2): 15, SGD(0.1): w = 1.5. Then (1, NaN), the NaN in
    device 1's half: skipped (w stays 1.5) and saved, with no
    `first_bad_replica` entry; reading it raises."""
    directory = str(tmp_path / "bad")
    distribution = keras.distribution.DataParallel(devices=jax.devices("cpu")[:2])
    with distribution.scope():
        model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=directory))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, shuffle=False, verbose=0)
        assert model.first_bad_replica is None
        history = model.fit(NAN_ON_1, Y, batch_size=2, shuffle=False, verbose=0)
        assert history.history["skipped_steps"] == [1.0]
        assert float(np.asarray(model.weights[0])[0, 0]) == 1.5
        with pytest.raises(RuntimeError, match=r"shared by 2 devices under DataParallel"):
            model.first_bad_replica  # noqa: B018
    (name,) = os.listdir(directory)
    with np.load(os.path.join(directory, name)) as saved:
        assert "first_bad_replica" not in saved.files
        assert bool(saved["skipped"]) and int(saved["step"]) == 2
