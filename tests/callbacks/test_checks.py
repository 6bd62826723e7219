"""Tests for the callbacks' argument checks (keras_keepgrad._checks).

The hand model: one bias-free Dense(1) with a Constant(3.0) kernel, mse,
SGD(0.1), x = [[1], [2]], y = 0. loss = mean((w*x)^2), so
dL/dw = w * (1 + 4) = 5w: 15 at w = 3, then w' = 3 - 0.1*15 = 1.5 -> 7.5,
then 0.75 -> 3.75.
"""

import keras
import pytest
from callback_helpers import hand_data
from callback_helpers import hand_model

from keras_keepgrad import callbacks


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: callbacks.GradientTensorBoard(update_freq=0),
            "`update_freq` must be 'epoch', 'batch' or a positive int. Received: update_freq=0",
        ),
        (
            lambda: callbacks.GradientTensorBoard(update_freq="often"),
            "Received: update_freq='often'",
        ),
        (
            lambda: callbacks.GradientTensorBoard(update_freq=True),
            "Received: update_freq=True",
        ),
        (
            lambda: callbacks.GradientTensorBoard(histogram_freq=-1),
            "`histogram_freq` must be a non-negative int (0 disables it). "
            "Received: histogram_freq=-1",
        ),
        (
            lambda: callbacks.GradientTensorBoard(gradient_histogram_freq="epoch"),
            "`gradient_histogram_freq` must be 'batch' or a positive int. "
            "Received: gradient_histogram_freq='epoch'",
        ),
        (
            lambda: callbacks.GradientMonitor(action="panic"),
            "`action` must be one of ['warn', 'stop', 'raise']. Received: action='panic'",
        ),
        (
            lambda: callbacks.GradientMonitor(vanishing_threshold=-1e-6),
            "`vanishing_threshold` must be a finite number above 0 or None (off). "
            "Received: vanishing_threshold=-1e-06",
        ),
        (
            lambda: callbacks.GradientMonitor(exploding_factor=0.5),
            "`exploding_factor` must be a finite number above 1 or None (off). "
            "Received: exploding_factor=0.5",
        ),
        (
            lambda: callbacks.GradientMonitor(exploding_threshold=float("inf")),
            "Received: exploding_threshold=inf",
        ),
        (
            lambda: callbacks.GradientMonitor(vanishing_steps=0),
            "`vanishing_steps` must be a positive int. Received: vanishing_steps=0",
        ),
        (
            lambda: callbacks.GradientMonitor(recovery_steps=0),
            "`recovery_steps` must be a positive int. Received: recovery_steps=0",
        ),
        (
            lambda: callbacks.GradientMonitor(check_freq="epoch"),
            "`check_freq` must be a positive int. Received: check_freq='epoch'",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads.npy"),
            "`path` must end in '.npz'",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{batch}.npz"),
            "`path` may only hold the fields {step} and {epoch}",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{step[0]}.npz"),
            "`path` may only hold the fields {step} and {epoch} (with format "
            "specs like {step:06d}). Received: path='grads-{step[0]}.npz' "
            "(TypeError: 'int' object is not subscriptable)",
        ),
        (
            lambda: callbacks.GradientSnapshot("grads-{epoch.x}.npz"),
            "Received: path='grads-{epoch.x}.npz' (AttributeError: ",
        ),
        (
            lambda: callbacks.GradientSnapshot("g.npz", every=-2),
            "`every` must be 'epoch' or a positive int. Received: every=-2",
        ),
    ],
)
def test_invalid_arguments_raise_keras_style_errors(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize("path", [None, 3])
def test_a_snapshot_path_of_the_wrong_type_is_named(path):
    match = (
        r"`path` must be a str or os.PathLike naming an '.npz' file .*"
        rf"Received: path={path} of type {type(path).__name__}"
    )
    with pytest.raises(TypeError, match=match):
        callbacks.GradientSnapshot(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: callbacks.GradientReport(html=3),
            "`html` must be a file path (str or os.PathLike) or None. Received: html=3 of type int",
        ),
        (
            lambda: callbacks.GradientReport(print_table="yes"),
            "`print_table` must be a bool (True or False). Received: print_table='yes'",
        ),
        (
            lambda: callbacks.GradientReport(title=1),
            "`title` must be a str or None. Received: title=1 of type int",
        ),
    ],
)
def test_report_arguments_of_the_wrong_type_are_named(make, message):
    with pytest.raises(TypeError) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize("kind", ["tensorboard", "snapshot"])
def test_unwritable_path_fails_before_training(tmp_path, kind):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    if kind == "tensorboard":
        callback = callbacks.GradientTensorBoard(blocker / "logs")
        match = r"`log_dir` must be a path this process can write to\. Received: log_dir="
    else:
        callback = callbacks.GradientSnapshot(blocker / "g.npz")
        match = r"`path` must be a path this process can write to\. Received: path="
    model = hand_model()
    x, y = hand_data(1)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[callback])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0
    assert float(keras.ops.convert_to_numpy(model.get_layer("dense_0").kernel)[0, 0]) == 3.0


def test_callbacks_need_a_model_that_keeps_gradients(tmp_path):
    inputs = keras.Input((1,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile(optimizer="sgd", loss="mse")
    x, y = hand_data(1)
    with pytest.raises(
        TypeError, match=r"GradientMonitor needs a model that keeps gradients.*Functional"
    ):
        plain.fit(x, y, verbose=0, callbacks=[callbacks.GradientMonitor()])
    board = callbacks.GradientTensorBoard(tmp_path / "logs")
    with pytest.raises(TypeError, match=r"GradientTensorBoard needs a model that keeps"):
        plain.fit(x, y, verbose=0, callbacks=[board])
    assert not (tmp_path / "logs").exists()  # no log directory for a plain model
    model = hand_model()
    model.keep_gradients = False
    with pytest.raises(ValueError, match=r"GradientSnapshot .*`keep_gradients=False`"):
        model.fit(x, y, verbose=0, callbacks=[callbacks.GradientSnapshot(tmp_path / "g.npz")])
