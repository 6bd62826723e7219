"""The Keras-suite harness (tests/keras_suite) substitutes what it says.

The suite itself (Keras's own tests on plain Keras and on `KeepGradModel`)
takes about seven minutes on TensorFlow. Its training tests, and three of
its `_jit` training tests on PyTorch, run here before each release and on
every new Keras (`-m release`, or `-m keras_suite` for them alone; not in
CI); all of it runs with `python3 tests/keras_suite/run.py` (`--backend
torch` or `jax` for the others).
"""

import importlib.util
import os
import shutil
import types

import keras
import numpy as np
import pytest
from conftest import X
from conftest import Y
from conftest import dense_0

import keras_keepgrad as kg

SUITE = os.path.join(os.path.dirname(__file__), "keras_suite")


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"keras_suite_{name}", os.path.join(SUITE, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("run")
subs = _load("keepgrad_substitutes")


def _kernel_gradient_after_one_step(model, path):
    # loss = mean((w*x)^2), x = [1, 2], w = 3 -> d/dw = 5w = 15; SGD(0.1): 1.5.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0)
    assert model.get_gradients_by_path()[path].numpy().tolist() == [[15.0]]
    assert model.get_weights()[0].tolist() == [[1.5]]


def _kept_namespace():
    from keras.src import models as src_models
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.models.functional import Functional

    namespace = {
        "keras": keras,
        "models": src_models,
        "Model": keras.Model,
        "Sequential": keras.Sequential,
        "Functional": Functional,
        "Trainer": TensorFlowTrainer,
        "np": np,
        "layers": keras.layers,
    }
    rebound = subs.substitute(namespace)
    assert rebound == ["Functional", "Model", "Sequential", "Trainer", "keras", "models"]
    return types.SimpleNamespace(**namespace)


def test_substitute_rebinds_only_the_model_classes():
    kept = _kept_namespace()
    assert kept.Model is kg.KeepGradModel
    assert kept.keras.Model is kg.KeepGradModel
    assert kept.keras.models.Model is kg.KeepGradModel
    assert kept.models.Sequential is subs.KeepGradSequential
    assert kept.keras.Sequential is subs.KeepGradSequential
    assert kept.models.Functional is subs.functional_class()
    assert kept.Trainer is subs.KeepGradTrainer
    # Everything else is Keras's own.
    assert kept.keras.layers is keras.layers
    assert kept.keras.Input is keras.Input
    assert kept.models.cloning is keras.src.models.cloning
    assert kept.np is np and kept.layers is keras.layers


def test_substitute_keeps_the_names_asked():
    from keras.src.models.functional import Functional

    namespace = {"Functional": Functional, "Model": keras.Model}
    assert subs.substitute(namespace, keep=["Functional"]) == ["Model"]
    assert namespace == {"Functional": Functional, "Model": kg.KeepGradModel}


def test_kept_functional_trains_through_keepgradmodel():
    kept = _kept_namespace()
    inputs = keras.Input((1,))
    model = kept.keras.Model(inputs, dense_0()(inputs))
    assert isinstance(model, kg.KeepGradModel)
    _kernel_gradient_after_one_step(model, "dense_0/kernel")


def test_kept_sequential_trains_through_keepgradmodel():
    kept = _kept_namespace()
    model = kept.Sequential([keras.Input((1,)), dense_0()], name="seq")
    model.add(keras.layers.Identity())
    model.pop()
    assert isinstance(model, kg.KeepGradModel)
    assert isinstance(model, keras.Sequential)
    _kernel_gradient_after_one_step(model, "seq/dense_0/kernel")


def test_kept_trainer_mixin_trains_through_keepgradmodel():
    kept = _kept_namespace()

    # As trainer_test.py's `ExampleModel`, with the layer base first.
    class ExampleModel(kept.layers.Dense, kept.Trainer):
        def __init__(self):
            kept.layers.Dense.__init__(
                self,
                1,
                use_bias=False,
                kernel_initializer=keras.initializers.Constant(3.0),
                name="dense_0",
            )
            kept.Trainer.__init__(self)

    model = ExampleModel()
    assert model.units == 1 and model.name == "dense_0"  # not initialised again
    assert model(X).numpy().tolist() == [[3.0], [6.0]]  # Dense's call
    _kernel_gradient_after_one_step(model, "dense_0/kernel")


def test_kept_trainer_test_mixes_the_layer_in_first():
    with open(os.path.join(run.KERAS_SRC, "trainers", "trainer_test.py")) as f:
        source = f.read()
    kept = run.transform(source, "trainers/trainer_test.py", "kept")
    assert "class ExampleModel(layers.Dense, Trainer):" in kept
    assert "class StructModel(Trainer, layers.Layer):" in kept
    assert "self.layers" not in kept and kept.count("self.dense_layers") == 3
    assert kept.index("_keras_suite.substitute(globals(), keep=[])") < kept.index(
        "class ExampleModel"
    )
    assert run.transform(source, "trainers/trainer_test.py", "plain") == source.replace(
        run._JAX_IMPORT, run._JAX_GUARDED, 1
    )


def test_differences_are_tests_passing_plain_only():
    plain = {
        "a.py::t1": {"outcome": "passed"},
        "a.py::t2": {"outcome": "passed"},
        "a.py::t3": {"outcome": "failed"},
        "b.py::t4": {"outcome": "passed"},
        "a.py::t5": {"outcome": "passed"},
    }
    kept = {
        "a.py::t1": {"outcome": "passed", "message": ""},
        "a.py::t2": {"outcome": "failed", "message": "E: x"},
        "a.py::t3": {"outcome": "failed", "message": "E: y"},
        "b.py": {"outcome": "error", "message": "collection: E: z"},
    }
    assert run.differences(plain, kept) == {
        "a.py::t2": ("failed", "E: x"),
        "a.py::t5": ("missing", ""),
        "b.py::t4": ("error", "collection: E: z"),
    }


@pytest.mark.release
@pytest.mark.slow  # two pytest processes
def test_plain_tree_runs_only_what_did_not_pass_kept(tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    shutil.copy(os.path.join(SUITE, "suite_conftest.py"), root / "conftest.py")
    (root / "m_test.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='r')\n"
        "def test_c(): pass\n"
        "def test_d(): pass\n"
    )
    collected = run.collect_tree(str(root), ["m_test.py"], [], 300)
    assert collected == [f"m_test.py::test_{n}" for n in "abcd"]
    kept = {
        "m_test.py::test_a": {"outcome": "passed", "message": ""},
        "m_test.py::test_b": {"outcome": "failed", "message": "E"},
        "m_test.py::test_c": {"outcome": "skipped", "message": "r"},
    }  # test_d: missing, as when a kept file fails to import
    needed = run.plain_needed(collected, kept)
    assert needed == ["m_test.py::test_b", "m_test.py::test_c", "m_test.py::test_d"]
    plain, _, _ = run.run_tree(str(root), needed, [], 300)
    assert {k: v["outcome"] for k, v in plain.items()} == {
        "m_test.py::test_b": "failed",
        "m_test.py::test_c": "skipped",
        "m_test.py::test_d": "passed",
    }
    assert run.differences(plain, kept) == {"m_test.py::test_d": ("missing", "")}


def test_known_differences_need_a_reason_and_none_are_listed(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text("# a comment\n\na.py::t1  # fails plain only, on purpose\n")
    assert run.read_known_differences(str(path)) == {"a.py::t1": "fails plain only, on purpose"}
    path.write_text("# a comment\na.py::t2\n")
    with pytest.raises(ValueError, match=r"known.txt:2: a.py::t2 has no `# reason`"):
        run.read_known_differences(str(path))
    # KeepGradModel passes every selected Keras test that plain Keras passes.
    assert run.read_known_differences(run.KNOWN_DIFFERENCES) == {}


def test_known_differences_hold_on_the_backend_they_name(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text(
        "a.py::t1  # on every backend\n"
        "[jax] a.py::t2  # on JAX only\n"
        "[torch]a.py::t*  # on PyTorch only\n"
    )
    assert run.read_known_differences(str(path), "tensorflow") == {"a.py::t1": "on every backend"}
    assert run.read_known_differences(str(path), "jax") == {
        "a.py::t1": "on every backend",
        "a.py::t2": "on JAX only",
    }
    assert run.read_known_differences(str(path), "torch") == {
        "a.py::t1": "on every backend",
        "a.py::t*": "on PyTorch only",
    }
    path.write_text("[numpy] a.py::t1  # not a backend of the suite\n")
    with pytest.raises(
        ValueError,
        match=r"known.txt:1: the prefix must be one of \[tensorflow\], \[jax\], \[torch\], "
        r"or none for every backend. Received: \[numpy\]",
    ):
        run.read_known_differences(str(path), "jax")
    # A prefixed line needs its reason too.
    path.write_text("[jax] a.py::t2\n")
    with pytest.raises(ValueError, match=r"known.txt:1: a.py::t2 has no `# reason`"):
        run.read_known_differences(str(path), "tensorflow")


# As trainer_test.py: `Trainer` is the running backend's trainer, mixed in
# after a layer (as the kept copy writes it). Checked on that backend.
_TINY_TRAINER_TEST = """\
import keras
import numpy as np
from keras.src import backend
from keras.src import initializers
from keras.src import layers

if backend.backend() == "jax":
    from keras.src.backend.jax.trainer import JAXTrainer as Trainer
elif backend.backend() == "torch":
    from keras.src.backend.torch.trainer import TorchTrainer as Trainer
else:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as Trainer

import keras_keepgrad as kg
import keepgrad_substitutes


class ExampleModel(layers.Dense, Trainer):
    def __init__(self):
        layers.Dense.__init__(
            self, 1, use_bias=False, kernel_initializer=initializers.Constant(3.0), name="dense_0"
        )
        Trainer.__init__(self)


def test_the_backends_trainer_is_kept():
    assert backend.backend() == "{backend}"
    assert Trainer is keepgrad_substitutes.KeepGradTrainer
    model = ExampleModel()
    assert isinstance(model, kg.KeepGradModel)
    # loss = mean((w*x)^2), x = [1, 2], w = 3 -> d/dw = 5w = 15; SGD(0.1): 1.5.
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.array([[1.0], [2.0]], dtype="float32")
    model.fit(x, np.zeros((2, 1), dtype="float32"), batch_size=2, verbose=0)
    grad = model.get_gradients_by_path()["dense_0/kernel"]
    assert keras.ops.convert_to_numpy(grad).tolist() == [[15.0]]
    assert model.get_weights()[0].tolist() == [[1.5]]
"""


@pytest.mark.release
@pytest.mark.slow  # a pytest process on each backend
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_kept_trainer_is_the_running_backends(tmp_path, backend):
    root = tmp_path / "kept"
    root.mkdir()
    shutil.copy(os.path.join(SUITE, "suite_conftest.py"), root / "conftest.py")
    shutil.copy(os.path.join(SUITE, "keepgrad_substitutes.py"), root)
    source = _TINY_TRAINER_TEST.replace("{backend}", backend)
    kept = run._insert_substitution(source, "m_test.py")
    assert kept.index("_keras_suite.substitute(globals(), keep=[])") < kept.index(
        "class ExampleModel"
    )
    (root / "m_test.py").write_text(kept)
    outcomes, _, log = run.run_tree(str(root), ["m_test.py"], [], 900, backend)
    with open(log) as f:
        assert outcomes == {
            "m_test.py::test_the_backends_trainer_is_kept": {
                "outcome": "passed",
                "message": "",
                "seconds": outcomes["m_test.py::test_the_backends_trainer_is_kept"]["seconds"],
            }
        }, f.read()[-3000:]


# The release run takes Keras's training tests (trainer_test.py, where `fit`,
# `train_step`, the optimizers and loss scaling meet a model; the other two
# files of `trainers/` never make a model), and leaves to the whole run by
# hand (tests/keras_suite/README.md) the model, saving and callback files
# (~250 s), which the library's own test_model, test_saving and callbacks
# tests cover on KeepGradModel; and of trainer_test.py the 37
# `steps_per_execution` cases (~100 s), Keras's loop of several steps a
# call, which test_model.py's
# test_steps_per_execution_callbacks_see_the_last_step and test_metrics.py's
# test_reductions_over_a_three_step_epoch run on KeepGradModel.
TRAINING = ("--files", "trainers/trainer_test.py", "-k", "not steps_per_execution")


@pytest.mark.release
@pytest.mark.slow
@pytest.mark.keras_suite
def test_keras_suite_passes_on_keepgradmodel():
    assert run.main(list(TRAINING)) == 0


# Keras's training tests with `jit_compile=True`, which on PyTorch is
# `torch.compile`: the keeping runs eagerly between its compiled pieces
# (`_torch_compile`), and these compare losses, weights and callback counts
# with plain Keras's: `test_fit_flow`'s two and, of the `test_steps_per_epoch`
# cases, the one that stops short (the others, ~25 s each, fit as
# `test_fit_flow`'s `steps_per_epoch` case does). `test_fit_with_val_split`'s
# two (~35 s) run by hand: the compiled evaluation they add is
# torch_backend's test_jit_compile_compiles_the_step_and_keeps_outside_it.
# The rest of the suite on JAX and PyTorch, about 20 minutes each, is run by
# hand too (tests/keras_suite/README.md).
TORCH_JIT_TRAINING = (
    "_jit and not non_jit and (test_fit_flow or test_steps_per_epoch_not_match_too_low)"
)


@pytest.mark.release
@pytest.mark.slow
@pytest.mark.keras_suite
def test_keras_suite_jit_training_passes_on_torch():
    args = ["--backend", "torch", "--files", "trainers/trainer_test.py", "-k", TORCH_JIT_TRAINING]
    assert run.main(args) == 0
