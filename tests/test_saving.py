"""Saving: what Keras's files hold with and without the kept gradients.

The one-weight model of conftest.py: one SGD(0.1) step on x = [[1], [2]],
y = 0 keeps the gradient 5w = 15 and moves w from 3 to 1.5; each further
step on the same batch halves w again (gradient 7.5, 3.75, ...).
"""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import W0
from conftest import Recorder
from conftest import X
from conftest import Y
from conftest import dense_0
from conftest import one_weight
from conftest import python_env

import keras_keepgrad as kg
from keras_keepgrad import _saving

GRAD_KEY = "_kept_gradients/vars/0:dense_0%2Fkernel"

# Models a fresh process must load from their registered names alone.
MODELS_MODULE = '''
import keras
import keras_keepgrad as kg


def _dense():
    return keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(3.0),
        name="dense_0")


@keras.saving.register_keras_serializable(package="test_saving")
class KeptNet(kg.KeepGradModel):
    """A subclassed `KeepGradModel` with `get_config`."""

    def __init__(self, units=1, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = _dense()

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_saving")
class PlainNet(keras.Model):
    """A plain subclassed model, to wrap with `keep_gradients()`."""

    def __init__(self, units=1, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = _dense()

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}
'''


# --- helpers ------------------------------------------------------------------


def compiled_one_weight(cls=kg.KeepGradModel, name="net", layer="dense_0", **options):
    model = one_weight(cls, layer=layer, name=name, **options)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def trained(cls=kg.KeepGradModel, steps=1, **options):
    model = compiled_one_weight(cls, **options)
    model.fit(
        np.tile(X, (steps, 1)), np.tile(Y, (steps, 1)), batch_size=2, shuffle=False, verbose=0
    )
    return model


def h5_arrays(path):
    """`{dataset path: array}` of a .weights.h5 file or of a .keras archive."""
    if str(path).endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            path = io.BytesIO(archive.read("model.weights.h5"))
    found = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                found[name] = obj[()]

        f.visititems(visit)
    return found


def assert_same_arrays(found, expected):
    assert sorted(found) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(found[key], value, err_msg=key)


@contextlib.contextmanager
def warns(category, match):
    """Like `pytest.warns`, without re-emitting the third-party deprecation
    warnings that saving raises (they are ignored by pyproject's filters)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert any(
        issubclass(w.category, category) and re.search(match, str(w.message)) for w in caught
    ), [str(w.message) for w in caught]


def kernel_grad(model):
    return keras.ops.convert_to_numpy(model.gradients["dense_0"]["kernel"]).tolist()


def only_grad(model):
    """The one kept gradient, whatever its path (Sequential prefixes it)."""
    (grad,) = model.get_gradients_by_path().values()
    return keras.ops.convert_to_numpy(grad).tolist()


def saved_gradients(path):
    return {k: v for k, v in h5_arrays(path).items() if k.startswith("_kept_gradients/")}


def save(model, path):
    if str(path).endswith(".keras"):
        model.save(path)
    else:
        model.save_weights(path)


# --- what the files hold --------------------------------------------------------


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
@pytest.mark.parametrize("save_gradients", [False, True])
def test_files_hold_the_plain_arrays_and_gradients_only_on_request(
    tmp_path, suffix, save_gradients
):
    plain = trained(keras.Model)
    kept = trained(save_gradients=save_gradients)
    save(plain, tmp_path / f"plain{suffix}")
    save(kept, tmp_path / f"kept{suffix}")
    expected = h5_arrays(tmp_path / f"plain{suffix}")
    # The plain model's file: kernel 1.5, SGD iterations 1 and learning rate.
    assert sorted(expected) == ["layers/dense/vars/0", "optimizer/vars/0", "optimizer/vars/1"]
    if save_gradients:
        expected[GRAD_KEY] = np.array([[15.0]], "float32")
    assert_same_arrays(h5_arrays(tmp_path / f"kept{suffix}"), expected)


@pytest.mark.parametrize(
    "options, train",
    [
        (dict(save_gradients=True), False),  # nothing kept yet
        (dict(save_gradients=True, keep_gradients=False), True),
    ],
    ids=["untrained", "keep_gradients_off"],
)
def test_nothing_kept_means_nothing_saved(tmp_path, options, train):
    model = trained(**options) if train else compiled_one_weight(**options)
    model.save_weights(tmp_path / "m.weights.h5")
    assert saved_gradients(tmp_path / "m.weights.h5") == {}


def test_stale_gradients_are_not_saved_with_a_warning(tmp_path):
    model = trained(save_gradients=True)
    model.layers[-1].trainable = False  # the kept gradient no longer fits
    with warns(UserWarning, match="were not saved .*stale"):
        model.save_weights(tmp_path / "m.weights.h5")
    assert sorted(h5_arrays(tmp_path / "m.weights.h5")) == [
        "layers/dense/vars/0",
        "optimizer/vars/0",
        "optimizer/vars/1",
    ]


@pytest.mark.backends("tensorflow", reason="TensorFlow's sparse slots (IndexedSlices)")
@pytest.mark.parametrize("jit_compile", [False, True])
def test_sparse_gradient_is_saved_dense_and_restored_in_place(tmp_path, jit_compile):
    # mean over 4 rows of e[id]^2 with e = 1: d/de[i] = 2 * count(i) / 4,
    # ids 0, 0, 1, 2 -> [1, 0.5, 0.5, 0] (duplicate rows summed). Under
    # XLA too the slot is sparse (written after the compiled step).
    def embedding_model():
        inputs = keras.Input((1,), dtype="int32")
        emb = keras.layers.Embedding(4, 1, embeddings_initializer="ones", name="emb")(inputs)
        model = kg.KeepGradModel(inputs, emb, save_gradients=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
        return model

    ids = np.array([[0], [0], [1], [2]])
    target = np.zeros((4, 1, 1))
    model = embedding_model()
    model.fit(ids, target, batch_size=4, verbose=0)
    model.save_weights(tmp_path / "m.weights.h5")
    stored = h5_arrays(tmp_path / "m.weights.h5")["_kept_gradients/vars/0:emb%2Fembeddings"]
    np.testing.assert_array_equal(stored, [[1.0], [0.5], [0.5], [0.0]])

    train_function = model.train_function
    model.fit(np.full((4, 1), 3), target, batch_size=4, verbose=0)
    np.testing.assert_array_equal(model.gradients["emb"]["embeddings"], [[0], [0], [0], [2]])
    model.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_array_equal(
        model.gradients["emb"]["embeddings"], [[1.0], [0.5], [0.5], [0.0]]
    )
    # The restored slot holds all 4 rows; the same training function writes
    # the batch's again.
    e3 = model.get_weights()[0][3, 0]
    model.fit(np.full((4, 1), 3), target, batch_size=4, verbose=0)
    assert model.train_function is train_function
    np.testing.assert_array_equal(model.gradients["emb"]["embeddings"], [[0], [0], [0], [2 * e3]])


# --- restoring ------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_load_restores_saved_gradients_exactly(tmp_path, suffix):
    path = tmp_path / f"m{suffix}"
    save(trained(save_gradients=True), path)
    if suffix == ".keras":
        model = keras.models.load_model(path)
        assert isinstance(model, kg.KeepGradModel)
    else:
        model = compiled_one_weight()
        model.load_weights(path)
    # Before any training: dense slots made from the file.
    assert kernel_grad(model) == [[15.0]]
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}
    # Training rebuilds the slots, then keeps the new step's gradient: 5 * 1.5.
    model.fit(X, Y, batch_size=2, verbose=0)
    assert kernel_grad(model) == [[7.5]]
    assert model.get_weights()[0].tolist() == [[0.75]]


def test_load_weights_writes_the_slots_a_traced_step_writes(tmp_path):
    save(trained(save_gradients=True), tmp_path / "m.weights.h5")
    model = trained(steps=2)  # gradients 15 then 7.5; w = 0.75
    train_function = model.train_function
    model.load_weights(tmp_path / "m.weights.h5")  # w = 1.5, gradient 15
    assert kernel_grad(model) == [[15.0]]
    model.fit(X, Y, batch_size=2, verbose=0)
    # The same training function writes the slots the file was loaded into
    # (slots made anew would still read 15).
    assert model.train_function is train_function
    assert kernel_grad(model) == [[7.5]]


def test_a_file_without_gradients_leaves_them_alone(tmp_path):
    save(trained(keras.Model), tmp_path / "plain.weights.h5")
    model = trained(steps=2)
    model.load_weights(tmp_path / "plain.weights.h5")
    assert model.get_weights()[0].tolist() == [[1.5]]
    assert kernel_grad(model) == [[7.5]]  # still the last trained batch's


def test_keep_gradients_false_ignores_saved_gradients(tmp_path):
    save(trained(save_gradients=True), tmp_path / "m.weights.h5")
    model = compiled_one_weight(keep_gradients=False)
    model.load_weights(tmp_path / "m.weights.h5")
    assert model.get_weights()[0].tolist() == [[1.5]]
    assert model.kept_step is None
    with pytest.raises(AttributeError, match="keep_gradients=True"):
        model.gradients


# --- plain <-> kept -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["functional", "sequential", "sequential_without_input"])
@pytest.mark.parametrize("save_gradients", [False, True])
def test_weights_files_move_between_plain_and_kept_models(tmp_path, kind, save_gradients):
    def plain_model(built=True):
        if kind == "sequential":
            model = keras.Sequential([keras.Input((1,)), dense_0()])
        elif kind == "sequential_without_input":
            model = keras.Sequential([dense_0()])
            if built:  # Keras loads weights into built models only
                model.build((None, 1))
        else:
            inputs = keras.Input((1,))
            model = keras.Model(inputs, dense_0()(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    # kept -> plain, even with the gradients in the file.
    kept = kg.keep_gradients(plain_model(built=False), save_gradients=save_gradients)
    # An unbuilt Sequential has no inputs yet, so it is wrapped.
    wrapped = kind == "sequential_without_input"
    assert isinstance(kept, kg.wrapping.WrappedKeepGradModel) == wrapped
    kept.fit(X, Y, batch_size=2, verbose=0)
    kept.save_weights(tmp_path / "kept.weights.h5")
    saved = saved_gradients(tmp_path / "kept.weights.h5")
    assert [v.tolist() for v in saved.values()] == ([[[15.0]]] if save_gradients else [])
    plain = plain_model()
    plain.load_weights(tmp_path / "kept.weights.h5")
    assert plain.get_weights()[0].tolist() == [[1.5]]
    assert int(plain.optimizer.iterations) == 1

    # plain -> kept.
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 0.75
    plain.save_weights(tmp_path / "plain.weights.h5")
    kept.load_weights(tmp_path / "plain.weights.h5")
    assert kept.get_weights()[0].tolist() == [[0.75]]
    kept.fit(X, Y, batch_size=2, verbose=0)
    assert only_grad(kept) == [[3.75]]  # 5 * 0.75


class ScaledNet(keras.Model):
    """A plain subclassed model whose saved groups are named after its
    attributes: a list of layers (`blocks/dense/vars/0`, a list item named
    by its class) and a weight of its own (`vars/0`, a non-trainable 1 that
    leaves the gradient 5w)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [dense_0()]
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False, name="scale")

    def call(self, x):
        return self.blocks[0](x) * self.scale


def scaled_net():
    model = ScaledNet(name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("save_gradients", [False, True])
def test_weights_files_move_between_plain_and_wrapped_subclassed_models(tmp_path, save_gradients):
    plain = scaled_net()
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5
    plain.save_weights(tmp_path / "plain.weights.h5")
    kept = kg.keep_gradients(scaled_net(), save_gradients=save_gradients)
    kept.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5, gradient 15
    # Built by their first fit, both name the kernel as the plain model does
    # (not "net/net/dense_0/kernel").
    assert (
        [v.path for v in kept.weights]
        == [v.path for v in plain.weights]
        == ["net/scale", "net/dense_0/kernel"]
    )

    # The same groups as the plain model's file, with the same arrays.
    kept.save_weights(tmp_path / "kept.weights.h5")
    expected = h5_arrays(tmp_path / "plain.weights.h5")
    assert sorted(expected) == [
        "blocks/dense/vars/0",
        "optimizer/vars/0",
        "optimizer/vars/1",
        "vars/0",
    ]
    if save_gradients:
        expected["_kept_gradients/vars/0:net%2Fdense_0%2Fkernel"] = np.array([[15.0]], "float32")
    assert_same_arrays(h5_arrays(tmp_path / "kept.weights.h5"), expected)

    # kept -> plain.
    other = scaled_net()
    other.fit(X, Y, batch_size=2, epochs=2, verbose=0)  # w = 0.75, 2 steps
    other.load_weights(tmp_path / "kept.weights.h5")
    assert other.get_weights() == [1.0, [[1.5]]]
    assert int(other.optimizer.iterations) == 1

    # plain -> kept: its next step starts from the loaded weight.
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 0.75
    plain.scale.assign(2.0)
    plain.save_weights(tmp_path / "plain.weights.h5")
    kept.load_weights(tmp_path / "plain.weights.h5")
    assert [w.tolist() for w in kept.get_weights()] == [2.0, [[0.75]]]
    assert int(kept.optimizer.iterations) == 2
    kept.fit(X, Y, batch_size=2, verbose=0)
    assert only_grad(kept) == [[15.0]]  # 5 * scale^2 * w = 5 * 4 * 0.75


def test_a_wrapper_of_a_built_model_loads_and_saves_weights_before_training(tmp_path):
    plain = scaled_net()
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5
    plain.save_weights(tmp_path / "plain.weights.h5")
    net = ScaledNet(name="net")
    net(X)  # built by a call, as after training or loading
    kept = kg.keep_gradients(net)
    assert kept.built
    kept.load_weights(tmp_path / "plain.weights.h5")  # no optimizer yet
    assert [w.tolist() for w in net.get_weights()] == [1.0, [[1.5]]]
    net.scale.assign(2.0)
    kept.save_weights(tmp_path / "kept.weights.h5")
    assert_same_arrays(
        h5_arrays(tmp_path / "kept.weights.h5"), {"blocks/dense/vars/0": [[1.5]], "vars/0": 2.0}
    )
    kept.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    kept.fit(X, Y, batch_size=2, verbose=0)
    assert only_grad(kept) == [[30.0]]  # 5 * scale^2 * w = 5 * 4 * 1.5
    kept.save(tmp_path / "kept.keras")
    loaded = keras.models.load_model(
        tmp_path / "kept.keras", custom_objects={"ScaledNet": ScaledNet}
    )
    assert [w.tolist() for w in loaded.get_weights()] == [2.0, [[-1.5]]]  # 1.5 - 0.1 * 30
    assert loaded.built


class WithBackbone(keras.Model):
    """A subclassed model holding a sub-model under the attribute `model`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((1,))
        self.model = keras.Model(inputs, dense_0()(inputs), name="backbone")

    def call(self, x):
        return self.model(x)


def test_a_wrapped_model_attribute_named_model_is_saved_as_in_the_plain_file(tmp_path):
    def net():
        model = WithBackbone(name="net")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    plain = net()
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5
    plain.save_weights(tmp_path / "plain.weights.h5")
    original = net()
    kept = kg.keep_gradients(original)
    assert kept.model is original.model  # the original's own `model`
    kept.fit(X, Y, batch_size=2, verbose=0)
    kept.save_weights(tmp_path / "kept.weights.h5")
    assert (
        sorted(h5_arrays(tmp_path / "kept.weights.h5"))
        == sorted(h5_arrays(tmp_path / "plain.weights.h5"))
        == [
            # Keras saves the sub-model through `layers` (a list: named by its
            # class), which it visits before `model`.
            "layers/functional/layers/dense/vars/0",
            "optimizer/vars/0",
            "optimizer/vars/1",
        ]
    )
    plain.fit(X, Y, batch_size=2, verbose=0)  # w = 0.75
    plain.save_weights(tmp_path / "plain.weights.h5")
    kept.load_weights(tmp_path / "plain.weights.h5")
    assert kept.get_weights()[0].tolist() == [[0.75]]


def test_wrapped_subclassed_archive_holds_the_plain_arrays(tmp_path):
    plain = scaled_net()
    plain.fit(X, Y, batch_size=2, verbose=0)
    plain.save(tmp_path / "plain.keras")
    kept = kg.keep_gradients(scaled_net())
    kept.fit(X, Y, batch_size=2, verbose=0)
    kept.save(tmp_path / "kept.keras")
    assert_same_arrays(h5_arrays(tmp_path / "kept.keras"), h5_arrays(tmp_path / "plain.keras"))


def test_a_plain_archive_becomes_a_kept_model(tmp_path):
    plain = trained(keras.Model)  # w = 1.5
    plain.save(tmp_path / "plain.keras")
    model = kg.keep_gradients(
        keras.models.load_model(tmp_path / "plain.keras"), save_gradients=True
    )
    assert isinstance(model, kg.KeepGradModel)
    model.fit(X, Y, batch_size=2, verbose=0)
    assert kernel_grad(model) == [[7.5]]
    assert int(model.optimizer.iterations) == 2  # the optimizer came along
    model.save(tmp_path / "kept.keras")
    assert h5_arrays(tmp_path / "kept.keras")[GRAD_KEY].tolist() == [[7.5]]


# --- .keras in a fresh process -------------------------------------------------


@pytest.mark.backends(
    "tensorflow", reason="fresh processes: a slow check kept out of the per-backend runs"
)
@pytest.mark.slow
def test_keras_archives_round_trip_in_a_fresh_process(tmp_path):
    (tmp_path / "saving_models.py").write_text(MODELS_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        import saving_models
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("saving_models", None)

    options = dict(save_gradients=True, keep_every=2)
    inputs = keras.Input((1,))
    models = {
        "functional": kg.KeepGradModel(inputs, dense_0()(inputs), **options),
        "subclassed": saving_models.KeptNet(**options),
        "wrapped": kg.keep_gradients(saving_models.PlainNet(), **options),
        "from_sequential": kg.keep_gradients(
            keras.Sequential([keras.Input((1,)), dense_0()]), **options
        ),
    }
    for name, model in models.items():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, verbose=0)
        model.save(tmp_path / f"{name}.keras")

    code = f"""
        import json, sys
        import numpy as np
        import keras
        import keras_keepgrad as kg
        sys.path.insert(0, {str(tmp_path)!r})
        import saving_models  # registers KeptNet / PlainNet, as a user would

        out = {{}}
        for name in {sorted(models)!r}:
            model = keras.models.load_model({str(tmp_path)!r} + f"/{{name}}.keras")
            row = dict(
                cls=type(model).__name__,
                is_kept=isinstance(model, kg.KeepGradModel),
                options=[model.keep_gradients, model.save_gradients, model.keep_every],
                loaded=[g.numpy().tolist() for g in model.get_gradients_by_path().values()],
                weights=[w.tolist() for w in model.get_weights()],
            )
            x = np.array([[1.0], [2.0]], "float32")
            model.fit(x, np.zeros((2, 1), "float32"), batch_size=2, verbose=0)
            row["after_fit"] = [g.numpy().tolist()
                                for g in model.get_gradients_by_path().values()]
            out[name] = row
        print(json.dumps(out))
    """
    env = python_env()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, model in models.items():
        row = out[name]
        assert row["cls"] == type(model).__name__, name
        assert row["is_kept"], name
        assert row["options"] == [True, True, 2], name
        assert row["loaded"] == [[[15.0]]], name
        assert row["weights"] == [[[1.5]]], name
        assert row["after_fit"] == [[[7.5]]], name


# --- never in checkpoints or exports --------------------------------------------


@pytest.mark.backends("tensorflow", reason="tf.train.Checkpoint and tf.saved_model")
def test_tf_checkpoint_and_export_hold_no_gradient_slots(tmp_path):
    plain = trained(keras.Model)
    kept = trained(save_gradients=True)
    assert list(kept.get_gradients_by_path()) == ["dense_0/kernel"]  # a slot to leak
    listings = {}
    for name, model in (("plain", plain), ("kept", kept)):
        tf.train.Checkpoint(model=model).write(str(tmp_path / name / "ckpt"))
        model.export(str(tmp_path / name / "export"), verbose=False)
        listings[name] = (
            tf.train.list_variables(str(tmp_path / name / "ckpt")),
            tf.train.list_variables(str(tmp_path / name / "export/variables/variables")),
        )
    assert listings["kept"] == listings["plain"]
    ckpt, export = listings["kept"]
    assert [shape for _, shape in ckpt].count([1, 1]) == 1  # only the kernel
    loaded = tf.saved_model.load(str(tmp_path / "kept" / "export"))
    assert [v.shape.as_list() for v in loaded.variables] == [[1, 1]]
    np.testing.assert_array_equal(loaded.serve(X), [[1.5], [3.0]])


@pytest.mark.parametrize("save_weights_only", [True, False])
@pytest.mark.parametrize("save_gradients", [False, True])
def test_model_checkpoint_files_follow_save_gradients(tmp_path, save_weights_only, save_gradients):
    # `ModelCheckpoint` writes with `save_weights` / `save`: plain files by
    # default, the gradients too when the model was asked to save them.
    suffix = ".weights.h5" if save_weights_only else ".keras"
    for name, model in (
        ("plain", compiled_one_weight(keras.Model)),
        ("kept", compiled_one_weight(save_gradients=save_gradients)),
    ):
        checkpoint = keras.callbacks.ModelCheckpoint(
            str(tmp_path / f"{name}{suffix}"), save_weights_only=save_weights_only
        )
        model.fit(X, Y, batch_size=2, verbose=0, callbacks=[checkpoint])
    expected = h5_arrays(tmp_path / f"plain{suffix}")
    if save_gradients:
        expected[GRAD_KEY] = np.array([[15.0]], "float32")
    assert_same_arrays(h5_arrays(tmp_path / f"kept{suffix}"), expected)


class _Interrupt(keras.callbacks.Callback):
    """Raises before batch `batch` of epoch `epoch`, like a preemption."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_mid_epoch_with_gradients(tmp_path):
    # 2 epochs of 2 identical batches; each step halves w: 3, 1.5, 0.75, ...
    x, y = np.tile(X, (2, 1)), np.tile(Y, (2, 1))
    backup_dir = str(tmp_path / "backup")

    model = compiled_one_weight()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x,
            y,
            batch_size=2,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir, save_freq=1),
                _Interrupt(epoch=1, batch=1),
            ],
        )
    # Three steps ran (w = 0.375) and the last was backed up, without gradients.
    backup = h5_arrays(os.path.join(backup_dir, "latest.weights.h5"))
    assert sorted(backup) == ["layers/dense/vars/0", "optimizer/vars/0", "optimizer/vars/1"]
    assert backup["layers/dense/vars/0"].tolist() == [[0.375]]

    # A new process would build the model afresh: so does this.
    keras.backend.clear_session()
    model = compiled_one_weight()
    recorder = Recorder()
    history = model.fit(
        x,
        y,
        batch_size=2,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=1), recorder],
    )
    # Resumed at epoch 1 from w = 0.375 (Keras restarts the epoch's batches).
    assert list(zip(recorder.batches, recorder.seen)) == [((1, 0), 1.875), ((1, 1), 0.9375)]
    assert model.get_weights()[0].tolist() == [[0.09375]]
    assert int(model.optimizer.iterations) == 5
    assert len(history.history["loss"]) == 1


# --- bad input --------------------------------------------------------------------


def _rewrite_gradient(path, value):
    with h5py.File(path, "r+") as f:
        del f[GRAD_KEY]
        f[GRAD_KEY] = value


@pytest.mark.parametrize(
    "value, match",
    [
        (np.zeros((2, 1), "float32"), r"has shape \(2, 1\), but the variable has shape \(1, 1\)"),
        (np.zeros((1, 1), "float64"), r"has dtype float64, but the model keeps it as float32"),
    ],
    ids=["shape", "dtype"],
)
def test_mismatched_saved_gradients_raise_and_restore_nothing(tmp_path, value, match):
    path = tmp_path / "m.weights.h5"
    save(trained(save_gradients=True), path)
    _rewrite_gradient(path, value)
    model = trained(steps=2)  # w = 3 - 1.5 - 0.75, kept 7.5
    with pytest.raises(ValueError, match=match):
        model.load_weights(path)
    # Checked before Keras assigns anything: weights, optimizer, gradients.
    assert model.get_weights()[0].tolist() == [[0.75]]
    assert int(model.optimizer.iterations) == 2
    assert kernel_grad(model) == [[7.5]]
    # `skip_mismatch=True`: Keras's warning, the weights, not the gradients.
    with warns(UserWarning, match=match):
        model.load_weights(path, skip_mismatch=True)
    assert model.get_weights()[0].tolist() == [[1.5]]
    assert kernel_grad(model) == [[7.5]]


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_gradients_for_other_variables_raise_and_load_nothing(tmp_path, suffix):
    path = tmp_path / f"m{suffix}"
    save(trained(save_gradients=True), path)  # w = 1.5
    model = compiled_one_weight()
    model.layers[-1].trainable = False
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(
        ValueError,
        match=(
            r"holds gradients for 1 variables \(\['dense_0/kernel'\]\), but "
            r"model 'net' has 0 trainable variables \(\[\]\)"
        ),
    ):
        model.load_weights(path)
    # Keras would have loaded the weights and the optimizer before raising.
    assert model.get_weights()[0].tolist() == [[W0]]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0
    with pytest.raises(RuntimeError, match="no kept gradients yet"):
        model.gradients
    # Without the gradients, the weights load.
    with warns(UserWarning, match="holds gradients for 1 variables"):
        model.load_weights(path, skip_mismatch=True)
    assert model.get_weights()[0].tolist() == [[1.5]]


def test_gradients_of_an_edited_file_raise(tmp_path):
    path = tmp_path / "m.weights.h5"
    save(trained(save_gradients=True), path)
    with h5py.File(path, "r+") as f:
        f["_kept_gradients/vars/kernel"] = np.zeros((1, 1), "float32")
    with pytest.raises(ValueError, match="Unexpected dataset 'kernel'"):
        compiled_one_weight().load_weights(path)


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_truncated_file_gives_keras_error_and_overwrites_nothing(tmp_path, suffix):
    good = tmp_path / f"good{suffix}"
    save(trained(save_gradients=True, steps=3), good)  # w = 0.375, gradient 3.75
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])

    plain = trained(keras.Model)
    with pytest.raises(Exception) as plain_error:
        plain.load_weights(bad)
    model = trained(save_gradients=True)  # w = 1.5, gradient 15
    with pytest.raises(type(plain_error.value)) as kept_error:
        model.load_weights(bad)
    assert str(kept_error.value) == str(plain_error.value)
    assert model.get_weights()[0].tolist() == [[1.5]]
    assert kernel_grad(model) == [[15.0]]
    assert int(model.optimizer.iterations) == 1
    if suffix == ".keras":
        with pytest.raises(ValueError, match="accessible `.keras` zip file"):
            keras.models.load_model(bad)
    # The intact file still restores everything.
    shutil.copy(good, bad)
    model.load_weights(bad)
    assert kernel_grad(model) == [[3.75]]
    assert model.get_weights()[0].tolist() == [[0.375]]


def test_state_is_one_object_per_model():
    model = compiled_one_weight()
    state = _saving.kept_gradients_state(model)
    assert model._kept_gradients is state
    assert repr(state) == "<kept gradients of model 'net'>"
    assert compiled_one_weight(name="other")._kept_gradients is not state


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_bfloat16_gradients_load_back_into_a_fresh_model(tmp_path, suffix):
    # Keras writes bfloat16 arrays as 2-byte opaque data with a dtype
    # attribute; the gradients' pre-load check reads that attribute.
    model = one_weight(dtype="bfloat16", save_gradients=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)  # 5w = 15 at w = 3, exact in bfloat16
    path = str(tmp_path / f"m{suffix}")
    if suffix == ".keras":
        model.save(path)
    else:
        model.save_weights(path)
    fresh = one_weight(dtype="bfloat16", save_gradients=True)
    fresh.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fresh.fit(X, Y, batch_size=2, verbose=0)  # kept 15, then w = 1.5
    fresh.fit(X, Y, batch_size=2, verbose=0)  # kept 7.5
    fresh.load_weights(path)
    assert fresh.gradient_dtypes == {"dense_0/kernel": "bfloat16"}
    assert float(fresh.gradients["dense_0"]["kernel"][0, 0]) == 15.0
    assert float(fresh.get_weights()[0][0, 0]) == 1.5
