"""`skip_bad_steps` cases shared by every backend.

`tests/test_skipping.py` runs them on TensorFlow, and
`tests/any_backend/test_skipping.py` on JAX and PyTorch, in each
compilation mode (`conftest.MODES`).

The hand model: one bias-free Dense(1) with w = 3, y = 0, mse. A batch
x = [[p], [q]] gives loss = mean((w x)^2), so d/dw = w (p^2 + q^2): 15 for
(1, 2), 30 for (1, 3), 60 for (2, 4), 75 for (3, 4). With SGD(0.0) w stays
3, so these are every step's global gradient norms.
"""

import keras
import numpy as np
from conftest import LateBuilt
from conftest import X
from conftest import Y
from conftest import one_weight

import keras_keepgrad as kg

NAN_X = np.array([[np.nan], [2.0]], dtype="float32")


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


def nan_step_leaves_the_state_bit_identical(mode, model=None):
    """SGD(0.1, momentum=0.5): m1 = -0.1 * 15 = -1.5, w1 = 3 - 1.5 = 1.5;
    a NaN step changes nothing; then g = 5 * 1.5 = 7.5, m2 = 0.5 * -1.5 -
    0.75 = -1.5, w2 = 1.5 - 1.5 = 0."""
    model = model or one_weight(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", **mode)
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
    60 is skipped and joins the window ([60, 15, 15]: median 15); 30 is
    applied ([60, 30, 15]: median 30, limit 90); 75 is applied ([60, 30,
    75]: median 60, limit 180); 60 is applied. (`train_on_batch` resets
    the metrics: each call logs its own count.)"""
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=3.0, window=3))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    seen = []
    for p, q in [(1, 2), (1, 2), (1, 2), (2, 4), (1, 3), (3, 4), (2, 4)]:
        logs = model.train_on_batch(batch(p, q), Y, return_dict=True)
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


def history_counts_the_skipped_steps_per_epoch(mode):
    """Each epoch: (1, 2) three times, (2, 4), NaN, (1, 3); window 3,
    factor 3. Epoch 1: 60 is skipped (limit 45), NaN is skipped (and joins
    no window), 30 is applied: 2. Epoch 2 starts from [60, 30, 15]: the
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
        logs = m.train_on_batch(NAN_X, Y, return_dict=True)
        assert sorted(logs) == ["loss"]
        # Not skipped: the NaN reached the weight.
        assert np.isnan(float(np.asarray(m.weights[0])[0, 0]))
    assert len(model.metrics) == len(plain.metrics) == 1  # the loss's
    model.skip_bad_steps = kg.SkipBadSteps()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    assert float(model.train_on_batch(NAN_X, Y, return_dict=True)["skipped_steps"]) == 1.0


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
    model.train_on_batch(X, Y)
    assert float(kernel(model)[0, 0]) == 15.0
    assert float(np.asarray(model.weights[0])[0, 0]) == 1.5
    inner = [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables]
    weights = [np.asarray(v).tobytes() for v in model.weights]
    logs = model.train_on_batch(NAN_X, Y, return_dict=True)
    assert float(logs["skipped_steps"]) == 1.0
    assert [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables] == inner
    assert [np.asarray(v).tobytes() for v in model.weights] == weights
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    counter = float(np.asarray(optimizer.step_counter))
    logs = model.train_on_batch(batch(2, 4), Y, return_dict=True)
    assert float(kernel(model)[0, 0]) == 30.0
    assert float(logs["skipped_steps"]) == 1.0
    assert [np.asarray(v).tobytes() for v in model.weights] == weights
    assert [np.asarray(v).tobytes() for v in optimizer.inner_optimizer.variables] == inner
    assert float(np.asarray(optimizer.dynamic_scale)) == 1.0
    assert float(np.asarray(optimizer.step_counter)) == counter
