"""Canaries for `_compat`: each private Keras/TensorFlow/torch name it reaches.

Each test fails with a message naming the Keras version the helper was
written against when an upgrade moves what it reaches for.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_keepgrad import _compat

WRITTEN_AGAINST = "3.10 to 3.15"


@contextlib.contextmanager
def canary(helper):
    try:
        yield
    except Exception as e:
        pytest.fail(
            f"`_compat.{helper}` was written against Keras {WRITTEN_AGAINST}; with "
            f"Keras {keras.__version__} what it reaches for moved: {type(e).__name__}: {e}"
        )


def _functional():
    inputs = {"a": keras.Input((1,), name="a")}
    outputs = keras.layers.Dense(1, name="canary_dense")(inputs["a"])
    return inputs, outputs


def test_functional_construction():
    inputs, outputs = _functional()
    with canary("functional_init_arguments"):
        assert _compat.functional_init_arguments((inputs, outputs), {})
        assert not _compat.functional_init_arguments((), {"name": "x"})
    with canary("Functional"):
        assert isinstance(keras.Model(inputs, outputs), _compat.Functional)
    with canary("functional_structure"):
        structure = _compat.functional_structure(keras.Model(inputs, outputs))
        assert isinstance(structure[0], dict) and list(structure[0]) == ["a"]


def test_backend_trainer_and_saveable():
    with canary("BackendTrainer"):
        assert issubclass(keras.Model, _compat.BackendTrainer)
    with canary("KerasSaveable"):
        assert isinstance(keras.layers.Dense(1), _compat.KerasSaveable)


def test_compile_arguments_and_metrics():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    with canary("compile_arguments"):
        config = _compat.compile_arguments(model)
        assert config["loss"] == "mse" and config["optimizer"] is optimizer
    with canary("compiled_metrics_as_passed"):
        assert _compat.compiled_metrics_as_passed(model) == [["mae"], []]


def test_symbolic_build():
    with canary("in_symbolic_build"):
        assert _compat.in_symbolic_build() is False
        from keras.src.backend.common.symbolic_scope import SymbolicScope

        with SymbolicScope():
            assert _compat.in_symbolic_build() is True


def test_model_strategy():
    with canary("model_strategy"):
        assert _compat.model_strategy(keras.Sequential([keras.layers.Dense(1)])) is None
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(1)])
        assert _compat.model_strategy(model) is strategy


def test_optimizer_variables():
    variable = keras.Variable(np.ones((2,)), name="w")
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build([variable])
    with canary("optimizer_variables"):
        assert _compat.optimizer_variables(optimizer) == [variable]
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        scaled.build([variable])
        assert _compat.optimizer_variables(scaled) == [variable]


def test_replace_metric_variable():
    metric = keras.metrics.Mean()
    old = metric.variables[0]
    new = metric.add_variable(shape=(), initializer="zeros", name="canary")
    with canary("replace_metric_variable"):
        _compat.replace_metric_variable(metric, old, new)
        assert metric.variables[0] is new and len(metric.variables) == 2


def test_set_metric():
    layer = keras.layers.Dense(1)
    layer.canary_metric = keras.metrics.Mean()
    assert layer.metrics == [layer.canary_metric]
    layer.build((None, 1))  # its state locked
    with pytest.raises(ValueError, match="cannot add new elements of state"):
        layer.other_metric = keras.metrics.Mean()
    new = keras.metrics.Sum()
    with canary("set_metric"):
        _compat.set_metric(layer, "canary_metric", new)
        assert layer.metrics == [new]
        _compat.set_metric(layer, "canary_metric", None)
        assert layer.metrics == []
    # Locked again, with Keras's message.
    with pytest.raises(ValueError, match="cannot add new elements of state"):
        layer.other_metric = keras.metrics.Mean()


def test_tensorflow_pieces():
    with canary("tf_optimizer_class"):
        optimizer_class = _compat.tf_optimizer_class()
        assert isinstance(keras.optimizers.SGD(), optimizer_class)
        assert callable(optimizer_class._all_reduce_sum_gradients)
    with canary("collective_multi_worker"):
        assert not _compat.collective_multi_worker(tf.distribute.get_strategy())
    with canary("summary_ops"):
        assert callable(_compat.summary_ops().write_raw_proto_summary)
    graphs = []

    @tf.function
    def branch(x):
        def then():
            graphs.append(tf.compat.v1.get_default_graph())
            return x

        return tf.cond(x > 0, then, lambda: -x)

    branch(tf.constant(1.0))
    with canary("ControlFlowFuncGraph"):
        assert isinstance(graphs[0], _compat.ControlFlowFuncGraph)


def test_data_spec_from_epoch_iterator():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    iterator = TFEpochIterator(
        distribute_strategy=tf.distribute.get_strategy(),
        x=np.zeros((4, 1)),
        y=np.zeros((4, 1)),
        batch_size=2,
    )
    with canary("data_spec_from_epoch_iterator"):
        spec = _compat.data_spec_from_epoch_iterator(iterator)
        assert tuple(spec[0].shape)[1:] == (1,)  # (batch, 1), however the batch is known


def test_jax_trainer_methods():
    from keras.src.backend.jax.trainer import JAXTrainer

    with canary("make_function"):
        assert callable(JAXTrainer._make_function)
    with canary("state_sharding_spec"):
        if _compat.KERAS_VERSION < (3, 12):
            # The step itself constrains the state to the recorded shardings.
            assert callable(JAXTrainer._enforce_jax_state_sharding)
            assert not hasattr(JAXTrainer, "_get_state_sharding_spec")
            assert _compat.state_sharding_spec(None) is None
        else:
            assert callable(JAXTrainer._get_state_sharding_spec)
    with canary("follow_state_shardings"):
        import inspect

        if _compat.KERAS_VERSION < (3, 12):
            # The lists the step constrains the state to, which fit records.
            recorded = inspect.getsource(JAXTrainer._clear_jax_state_sharding)
            assert all(f"self.{name} = None" in recorded for name in _compat._STATE_SHARDINGS)

        class Recorded:
            _metrics_variable_shardings = ["one"]

        model = Recorded()
        value = tf.zeros(())  # stands for an array: only its count is compared
        _compat.follow_state_shardings(model, ([], [], [], [value]))
        assert model._metrics_variable_shardings == ["one"]
        if _compat.KERAS_VERSION < (3, 12):
            import jax

            array = jax.numpy.zeros(())
            _compat.follow_state_shardings(model, ([], [], [], [array, array]))
            assert model._metrics_variable_shardings == [array.sharding] * 2


def test_tensor_version():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(2)
    with canary("tensor_version"):
        before = _compat.tensor_version(tensor)
        tensor.add_(1.0)
        assert _compat.tensor_version(tensor) == before + 1


def test_last_batch_of_execution():
    seen = []
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    model.fit(np.zeros((8, 1)), np.zeros((8, 1)), batch_size=2, verbose=0, callbacks=[record])
    with canary("last_batch_of_execution"):
        # 4 batches, 2 per execution: Keras calls back after batches 1 and 3.
        assert [_compat.last_batch_of_execution(b, 2) for b in seen] == [1, 3]


def test_callback_model():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    callback = keras.callbacks.Callback()
    callback.set_model(model)
    with canary("callback_model"):
        assert _compat.callback_model(callback) is model
