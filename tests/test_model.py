"""End-to-end tests of `KeepGradModel`: the model and exactly what it keeps,
on numbers a person can check by hand (see conftest.py)."""

import collections
import contextlib
import inspect
import os
import subprocess
import sys
import textwrap
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import MODES
from conftest import REPO
from conftest import W0
from conftest import Recorder
from conftest import UpdatesByHand
from conftest import X
from conftest import Y
from conftest import dense_0
from conftest import fit_batches
from conftest import no_warning_on_jax
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad.backend.tensorflow import xla as tf_xla


def kernel(model):
    return model.gradients["dense_0"]["kernel"]


def run_py(code, env=None):
    full_env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
    )


# --- the analytic one-weight step -------------------------------------------


def test_kept_gradient_is_5w_and_the_sgd_step(mode):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    kept = keras.ops.convert_to_numpy(kernel(model))
    new_w = model.get_weights()[0]
    np.testing.assert_array_equal(kept, [[5 * W0]])  # 15
    np.testing.assert_array_equal(new_w, [[1.5]])
    np.testing.assert_allclose(kept, (W0 - new_w) / 0.1, rtol=1e-6)


class _OneWeightNet(kg.KeepGradModel):
    """The one-weight model, subclassed: built in the step from its input."""

    def __init__(self):
        super().__init__(name="net")
        self.dense = dense_0()

    def call(self, x):
        return self.dense(x)


def test_inputs_of_unknown_shape_keep_the_variables_shape(mode):
    # A dataset whose spec leaves every dimension unknown (as an iterable
    # torch DataLoader's does) for a built model: the traced kernel
    # gradient is (None, 1), the kernel (1, 1).
    spec = tf.TensorSpec((None, None), tf.float32)
    data = tf.data.Dataset.from_generator(lambda: iter([(X, Y)]), output_signature=(spec, spec))
    data = data.apply(tf.data.experimental.assert_cardinality(1))
    model = _OneWeightNet()
    model(X)  # built eagerly
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_array_equal(model.gradients["net"]["dense_0"]["kernel"], [[15.0]])
    assert model.get_weights()[0][0, 0] == 1.5


@pytest.mark.not_compiled_on_torch(
    reason="the steps one by one: torch_backend's "
    "test_keep_every_holds_its_copy_through_in_place_zeroing"
)
def test_every_batch_is_kept_in_order(mode):
    # Three identical batches: 5w with w = 3, 1.5, 0.75.
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    rec = fit_batches(model, 3)
    assert rec.seen == [15.0, 7.5, 3.75]
    # Before the first step there is no computed gradient to show.
    assert isinstance(rec.at_begin, RuntimeError)
    assert "no kept gradients yet" in str(rec.at_begin)


@pytest.mark.not_compiled_on_torch(
    reason="train_on_batch runs fit's step: test_kept_gradient_is_5w_and_the_sgd_step"
)
def test_train_on_batch_keeps_gradients(mode):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    model.train_on_batch(X, Y)
    np.testing.assert_array_equal(kernel(model), [[15.0]])
    model.train_on_batch(X, Y)
    np.testing.assert_array_equal(kernel(model), [[7.5]])


class _FailingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """SGD's learning rate 0.1, or an error inside the optimizer's update."""

    fails = True

    def __call__(self, step):
        if self.fails:
            raise ValueError("the schedule failed")
        return 0.1


@pytest.mark.not_compiled_on_torch(
    reason="the keeping, which makes the slots, runs eagerly under torch.compile: "
    "test_kept_gradient_is_5w_and_the_sgd_step's first step"
)
def test_a_first_step_that_raised_in_the_update_leaves_the_model_trainable(mode):
    # The slots are made as the first step is traced; that step raises
    # after, in the optimizer's update. The next `fit` trains as Keras
    # would: w = 3 - 0.1 * 15. (TensorFlow 2.21's `tf.function` returns
    # None, tracing nothing, after a first trace that made variables and
    # raised: the training function is made anew.)
    schedule = _FailingSchedule()
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse", **mode)
    with pytest.raises(ValueError, match="the schedule failed"):
        model.fit(X, Y, batch_size=2, verbose=0)
    schedule.fails = False
    logs = model.train_on_batch(X, Y, return_dict=True)
    assert logs["loss"] == 22.5
    np.testing.assert_array_equal(kernel(model), [[15.0]])
    assert float(np.asarray(model.get_layer("dense_0").kernel)[0, 0]) == 1.5


@pytest.mark.backends(
    "tensorflow", "jax", reason="Keras's PyTorch trainer refuses steps_per_execution > 1"
)
def test_steps_per_execution_callbacks_see_the_last_step():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=3)
    rec = fit_batches(model, 3)
    # One execution of three steps (15, 7.5, 3.75): the callback sees the last.
    assert rec.seen == [3.75]


def test_before_training_gradients_say_train_first():
    model = one_weight()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError, match="train it first"):
        model.gradients


# --- structure -----------------------------------------------------------


def test_structure_equals_state_tree_and_frozen_layer_is_absent():
    inputs = keras.Input((1,))
    hidden = dense_0(name="frozen", w=2.0)
    outputs = dense_0(name="head", w=W0)(hidden(inputs))
    model = kg.KeepGradModel(inputs, outputs)
    hidden.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    tree = model.get_state_tree()["trainable_variables"]
    grads = model.gradients
    assert keras.tree.map_structure(lambda _: 0, grads) == keras.tree.map_structure(
        lambda _: 0, tree
    )
    assert "frozen" not in grads
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(hidden.kernel), [[2.0]])
    # loss = mean((3*2*x)^2) -> d/dw_head = 2*w_head*h^2 mean = 2*3*4*2.5 = 60.
    np.testing.assert_array_equal(grads["head"]["kernel"], [[60.0]])


def test_recompile_after_unfreezing_rebuilds_the_slots():
    inputs = keras.Input((1,))
    hidden = dense_0(name="hidden", w=2.0)
    model = kg.KeepGradModel(inputs, dense_0(name="head")(hidden(inputs)))
    hidden.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert set(model.gradients) == {"head"}
    hidden.trainable = True
    with pytest.raises(RuntimeError, match="stale.*hidden/kernel"):
        model.gradients
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    # y = 3*2*x: d/dw_hidden = 2*mean(y*3*x) = 2*3*6*2.5 = 90, head as above.
    np.testing.assert_array_equal(model.gradients["hidden"]["kernel"], [[90.0]])
    np.testing.assert_array_equal(model.gradients["head"]["kernel"], [[60.0]])


def test_a_stale_training_function_is_refused_before_its_first_batch(tmp_path):
    inputs = keras.Input((1,))
    hidden = dense_0(name="hidden", w=2.0)
    model = kg.KeepGradModel(inputs, dense_0(name="head")(hidden(inputs)))
    hidden.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    # y = 3*2*x: d/dw_head = 2*mean(y*2x) = 24*2.5 = 60, so w_head = 3 - 6.
    weights = [[[2.0]], [[-3.0]]]
    np.testing.assert_array_equal(model.get_weights(), weights)
    hidden.trainable = True  # without `compile`: the old training function
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "g{step}.npz"), every=1)
    error, match = RuntimeError, r"GradientSnapshot .*stale.*\['hidden/kernel'\]"
    if keras.backend.backend() == "torch":
        # The PyTorch step follows the change, and Keras's optimizer refuses
        # the variable it was not built with.
        error, match = ValueError, "Unknown variable.*hidden/kernel"
    with pytest.raises(error, match=match):
        model.fit(X, Y, batch_size=2, verbose=0, callbacks=[snapshot])
    assert snapshot.files == []
    np.testing.assert_array_equal(model.get_weights(), weights)  # no batch applied
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1
    model.save(tmp_path / "model.keras")


def test_variable_the_loss_does_not_reach_keeps_zeros():
    class TwoHeads(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.used = dense_0(name="used")
            self.unused = dense_0(name="unused")

        def build(self, input_shape):
            self.used.build(input_shape)
            self.unused.build(input_shape)

        def call(self, x):
            return self.used(x)

    model = TwoHeads()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # Keras's optimizer warns of a None gradient; `jax.grad` gives zeros.
    with no_warning_on_jax(UserWarning, match="Gradients do not exist"):
        model.fit(X, Y, batch_size=2, verbose=0)
    grads = model.gradients["two_heads"]
    np.testing.assert_array_equal(grads["used"]["kernel"], [[15.0]])
    np.testing.assert_array_equal(grads["unused"]["kernel"], [[0.0]])
    assert keras.backend.standardize_dtype(grads["unused"]["kernel"].dtype) == "float32"


# --- loss scaling and mixed precision ------------------------------------


SCALINGS = {
    "none": lambda: keras.optimizers.SGD(0.1),
    "static": lambda: keras.optimizers.SGD(0.1, loss_scale_factor=1024.0),
    "dynamic": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=256.0, dynamic_growth_steps=2
    ),
}


@pytest.mark.not_compiled_on_torch(
    reason="tests/torch_backend: test_loss_scale_optimizer_keeps_the_unscaled_gradient_once, "
    "test_mixed_precision_is_unscaled_under_jit_compile"
)
@pytest.mark.parametrize("jit", [False, True], ids=["no_jit", "jit"])
def test_kept_gradients_are_unscaled_in_every_scaling_mode(jit):
    seen = {}
    for name, make in SCALINGS.items():
        model = one_weight()
        model.compile(optimizer=make(), loss="mse", jit_compile=jit)
        # Four steps: the dynamic scale doubles twice on the way.
        rec = fit_batches(model, 4)
        seen[name] = (rec.seen, model.get_weights()[0].tolist())
    assert seen["none"][0] == [15.0, 7.5, 3.75, 1.875]
    assert seen["static"] == seen["none"]
    assert seen["dynamic"] == seen["none"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_policies_end_to_end(policy):
    keras.config.set_dtype_policy(policy)
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if policy == "mixed_float16":
        # Keras wraps the optimizer itself under mixed_float16.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    rec = fit_batches(model, 4)
    # 3, 6, 1.5, 3 and their squares are exact in float16 and bfloat16.
    if policy == "mixed_bfloat16":
        assert rec.seen == [15.0, 7.5, 3.75, 1.875]
    else:
        # Keras's default scale 2**15 overflows the float16 activations'
        # gradients (6 * scale > 65504) until it has halved to 4096: three
        # skipped steps that keep their non-finite gradients, then 5w.
        assert [np.isfinite(g) for g in rec.seen] == [False, False, False, True]
        assert rec.seen[3] == 15.0
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


class RecordingSGD(keras.optimizers.SGD):
    """Records the gradient dtypes its update receives (at trace time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received = []

    def apply(self, grads, trainable_variables=None):
        self.received.append([keras.backend.standardize_dtype(g.dtype) for g in grads])
        return super().apply(grads, trainable_variables)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("loss_scale", ["dynamic", "none"])
def test_slot_dtype_is_what_the_inner_optimizer_receives(dtype, loss_scale):
    model = one_weight(dtype=dtype)
    inner = RecordingSGD(0.1)
    optimizer = inner
    if loss_scale == "dynamic":
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    model.compile(optimizer=optimizer, loss="mse")
    rec = Recorder()
    model.fit(X, Y, batch_size=2, verbose=0, callbacks=[rec])
    received = inner.received[-1][0]
    # float16/bfloat16 gradients divided by the float32 dynamic scale are
    # float32; without a LossScaleOptimizer they keep the variable's dtype,
    # as on PyTorch, whose LossScaleOptimizer unscales in the gradients' dtype.
    expected = dtype
    if loss_scale == "dynamic" and keras.backend.backend() != "torch":
        expected = "float32"
    assert received == expected
    assert model.gradient_dtypes["dense_0/kernel"] == expected
    assert keras.backend.standardize_dtype(kernel(model).dtype) == expected
    assert rec.seen == [15.0]


def test_step_skipped_by_dynamic_scaling_keeps_its_non_finite_gradients():
    # float16 kernel: the scaled gradient 15*scale overflows float16 (65504)
    # and so do the y*scale on the way, until scale = 4096.
    model = one_weight(dtype="float16")
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=32768.0
    )
    model.compile(optimizer=optimizer, loss="mse")
    rec = fit_batches(model, 4)
    assert [np.isfinite(g) for g in rec.seen] == [False, False, False, True]
    assert rec.seen[3] == 15.0  # the skipped steps left w = 3 unchanged
    np.testing.assert_array_equal(model.get_weights()[0], [[1.5]])
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == 4096.0


# --- optimizer transformations -------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(clipnorm=1.0),
        dict(global_clipnorm=1.0),
        dict(clipvalue=0.5),
        dict(weight_decay=0.5),
        dict(gradient_accumulation_steps=2),
        dict(use_ema=True, ema_momentum=0.5),
    ],
    ids=lambda o: next(iter(o)),
)
def test_kept_gradients_are_pre_transform(options):
    def compiled(cls):
        model = one_weight(cls=cls)
        model.compile(optimizer=keras.optimizers.SGD(0.1, **options), loss="mse")
        return model

    kept, plain, one_step = compiled(kg.KeepGradModel), compiled(keras.Model), compiled(keras.Model)
    rec = fit_batches(kept, 2)
    plain.fit(np.tile(X, (2, 1)), np.tile(Y, (2, 1)), batch_size=2, shuffle=False, verbose=0)
    one_step.fit(X, Y, batch_size=2, verbose=0)
    # The optimizer transformed the updates exactly as for a plain model ...
    np.testing.assert_array_equal(kept.get_weights()[0], plain.get_weights()[0])
    w1 = float(one_step.get_weights()[0][0, 0])
    if "gradient_accumulation_steps" in options:
        assert w1 == W0  # the first batch only accumulates
    elif "use_ema" not in options:  # EMA equals the weight after one step
        assert w1 != 1.5  # not the plain SGD step 3 - 0.1 * 15
    # ... while the kept values are the raw per-batch gradients 5w.
    assert rec.seen[0] == 15.0
    assert rec.seen[1] == pytest.approx(5 * w1, rel=1e-6)


def test_overwrite_with_gradient_variables_keep_the_value_written():
    class Scaled(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(
                shape=(), initializer=keras.initializers.Constant(W0), name="w"
            )
            # Like an FP8 scale: the optimizer writes its "gradient" into it.
            self.s = self.add_weight(
                shape=(), initializer="zeros", name="s", overwrite_with_gradient=True
            )

        def call(self, x):
            return x * self.w

    inputs = keras.Input((1,))
    layer = Scaled(name="scaled")
    model = kg.KeepGradModel(inputs, layer(inputs))

    class PlusNineS(keras.losses.Loss):
        def call(self, y_true, y_pred):
            # d(loss)/ds = 9, so Keras assigns s = 9.
            return keras.ops.mean(keras.ops.square(y_pred), axis=-1) + 9.0 * layer.s

    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=PlusNineS())
    model.fit(X, Y, batch_size=2, verbose=0)
    assert float(keras.ops.convert_to_numpy(layer.s)) == 9.0
    np.testing.assert_array_equal(model.gradients["scaled"]["s"], 9.0)
    np.testing.assert_array_equal(model.gradients["scaled"]["w"], 15.0)


# --- sparse gradients ----------------------------------------------------


def _embedding_net(optimizer, cls=kg.KeepGradModel, compile_options=None, **options):
    """Embedding(5, 2) of ones, flattened, into one Dense unit of ones: for
    ids [[1, 1, 3], [0, 1, 4]] every output is 6."""
    inputs = keras.Input((3,), dtype="int32")
    embed = keras.layers.Embedding(5, 2, embeddings_initializer="ones", name="emb")
    head = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="head")
    model = cls(inputs, head(keras.layers.Flatten()(embed(inputs))), **options)
    model.compile(optimizer=optimizer, loss="mse", **(compile_options or {}))
    return model


def _embedding_pair(make_optimizer, compile_options, **options):
    """`(kept, plain)`: `_embedding_net` as a `KeepGradModel` (with `options`)
    and as a `keras.Model`, each with its own `make_optimizer()`."""
    return (
        _embedding_net(make_optimizer(), kg.KeepGradModel, compile_options, **options),
        _embedding_net(make_optimizer(), keras.Model, compile_options),
    )


@pytest.mark.not_compiled_on_torch(
    reason="a dense gradient on PyTorch: test_kept_gradient_is_5w_and_the_sgd_step"
)
@pytest.mark.parametrize("mode_name", list(MODES))
def test_embedding_gradient_is_dense_with_repeated_ids_summed(mode_name):
    ids = np.array([[1, 1, 3], [0, 1, 4]], dtype="int32")
    model = _embedding_net(keras.optimizers.SGD(0.0), compile_options=MODES[mode_name])
    y = np.zeros((2, 1), dtype="float32")
    model.fit(ids, y, batch_size=2, verbose=0)

    kept = model.gradients["emb"]["embeddings"]
    # By hand: every output is 6, d(loss)/d(output) = 6 per sample, each
    # occurrence of an id adds 6 to both components: id 1 occurs 3 times.
    expected = [[6.0, 6.0], [18.0, 18.0], [0.0, 0.0], [6.0, 6.0], [6.0, 6.0]]
    np.testing.assert_array_equal(kept, expected)


class _EmbeddingNet(kg.KeepGradModel):
    """`_embedding_net` subclassed: its ids reach the layer uncast."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(5, 2, embeddings_initializer="ones", name="emb")
        self.head = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="head")

    def call(self, ids):
        return self.head(keras.ops.reshape(self.emb(ids), (-1, 6)))


@pytest.mark.backends("tensorflow", reason="TensorFlow's sparse slots (IndexedSlices)")
@pytest.mark.parametrize("jit_compile", [False, True])
def test_ids_of_another_dtype_retrace_into_the_same_sparse_slot(jit_compile):
    # A subclassed model's int32 ids after int64 ones retrace the training
    # function; the sparse slot made for int64 indices takes the int32 ones
    # (cast) instead of a new variable, which TensorFlow forbids mid-trace.
    model = _EmbeddingNet(name="net")
    model.compile(keras.optimizers.SGD(0.0), "mse", jit_compile=jit_compile)
    y = np.zeros((2, 1), "float32")
    model.fit(np.array([[1, 1, 3], [0, 1, 4]], "int64"), y, verbose=0)
    slot = model._keeper._slots["net/emb/embeddings"]
    model.fit(np.array([[2, 2, 2], [0, 0, 1]], "int32"), y, verbose=0)

    assert model._keeper._slots["net/emb/embeddings"] is slot
    # Every output is 6, d(loss)/d(output) = 6 per sample: 6 per occurrence,
    # id 2 three times, id 0 twice, id 1 once.
    kept = model.gradients["net"]["emb"]["embeddings"]
    np.testing.assert_array_equal(kept[:, 0], [12.0, 6.0, 18.0, 0.0, 0.0])
    np.testing.assert_array_equal(kept[:, 1], kept[:, 0])


@pytest.mark.backends("tensorflow", reason="XLA's sparse slots and tf.distribute")
@pytest.mark.parametrize("keep_every", [1, 2])
@pytest.mark.parametrize("setup", ["fit", "steps_per_execution", "mirrored"])
def test_under_xla_sparse_gradients_are_kept_as_the_batch_rows(keep_every, setup):
    # XLA cannot write a variable whose row count follows the batch, so the
    # compiled step hands the rows out and they are written after it: the
    # slot is (values, indices), also for the last, smaller batch. Under a
    # strategy (here one replica) the step must stay whole: dense slots.
    ids = np.array([[1, 1, 3], [0, 1, 4], [2, 2, 2]], dtype="int32")
    scope = (
        tf.distribute.MirroredStrategy(["/cpu:0"]).scope()
        if setup == "mirrored"
        else contextlib.nullcontext()
    )
    with scope:
        model = _embedding_net(
            keras.optimizers.SGD(0.0),
            compile_options=dict(
                jit_compile=True,
                steps_per_execution=2 if setup == "steps_per_execution" else 1,
            ),
            keep_every=keep_every,
        )
    model.fit(ids, np.zeros((3, 1), "float32"), batch_size=2, shuffle=False, verbose=0)

    assert model.jit_compile is True
    slot = model._keeper._slots["emb/embeddings"]
    kept = model.gradients["emb"]["embeddings"]
    if keep_every == 1:
        # Step 2, the batch [[2, 2, 2]]: output 6, d(loss)/d(output) =
        # 2 * 6 / 1 = 12, and id 2 occurs 3 times: 36 per component.
        rows = [2, 2, 2]
        np.testing.assert_array_equal(kept[:, 0], [0.0, 0.0, 36.0, 0.0, 0.0])
    else:
        # Only step 1 is written: 6 per occurrence, as in the test above.
        rows = [1, 1, 3, 0, 1, 4]
        np.testing.assert_array_equal(kept[:, 0], [6.0, 18.0, 0.0, 6.0, 6.0])
    np.testing.assert_array_equal(kept[:, 1], kept[:, 0])
    if setup == "mirrored":
        assert slot.indices is None and slot.values.shape == (5, 2)
    else:
        np.testing.assert_array_equal(slot.indices.numpy(), rows)
        assert slot.values.numpy().shape == (len(rows), 2)
    # The dense slot, written inside XLA: every feature is 1, so each kernel
    # entry's gradient is the batch's sum of d(loss)/d(output): 2 * 6 or 12.
    np.testing.assert_array_equal(model.gradients["head"]["kernel"], np.full((6, 1), 12.0))


def _ops_inside_and_outside_xla(model, dataset):
    """`(inside, outside)`: Counters of the op types in the traced training
    function, inside functions XLA must compile (and what they call) and
    outside them. Each function body counts once per side, however often
    it is called."""
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
    # Keras 3.15: `train_function` is a Python function around the
    # `tf.function` `multi_step_on_iterator`.
    traced = inspect.getclosurevars(model.train_function).nonlocals["multi_step_on_iterator"]
    graph_def = traced.get_concrete_function(iterator).graph.as_graph_def()
    functions = {f.signature.name: f for f in graph_def.library.function}
    counts = {True: collections.Counter(), False: collections.Counter()}
    seen = set()

    def must_compile(attrs):
        return "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b

    def walk(nodes, inside):
        for node in nodes:
            counts[inside][node.op] += 1
            for attr in node.attr.values():
                for name in [attr.func.name] + [f.name for f in attr.list.func]:
                    if name not in functions:
                        continue
                    compiled = (
                        inside or must_compile(node.attr) or must_compile(functions[name].attr)
                    )
                    if (name, compiled) not in seen:
                        seen.add((name, compiled))
                        walk(functions[name].node_def, compiled)

    walk(graph_def.node, False)
    return counts[True], counts[False]


@pytest.mark.backends("tensorflow", reason="XLA's sparse slots")
@pytest.mark.parametrize("optimizer, rows", [("sgd", True), ("adam", False)])
def test_under_xla_the_step_is_compiled_and_only_rows_are_written_outside(optimizer, rows):
    # The traced training function: XLA compiles the forward and backward
    # pass, the update and the dense slot writes; only the two writes of a
    # sparse slot (its values and indices) are outside, and none when the
    # slot is dense.
    ids = np.array([[1, 1, 3], [0, 1, 4]], dtype="int32")
    y = np.zeros((2, 1), "float32")
    make = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer]
    kept, plain = _embedding_pair(lambda: make(0.0), {"jit_compile": True})
    dataset = tf.data.Dataset.from_tensors((ids, y))
    for model in (kept, plain):
        model.fit(dataset, shuffle=False, verbose=0)
    kept_in, kept_out = _ops_inside_and_outside_xla(kept, dataset)
    plain_in, plain_out = _ops_inside_and_outside_xla(plain, dataset)

    assert kept_out["AssignVariableOp"] == (2 if rows else 0)
    assert plain_out["AssignVariableOp"] == 0
    # Inside: plain Keras's variable writes, plus the head's slot, plus the
    # table's slot when it is dense.
    assert kept_in["AssignVariableOp"] == plain_in["AssignVariableOp"] + (1 if rows else 2)
    # Every other variable write (the update, the optimizer's iterations, the loss
    # tracker) is inside in both, the same ones.
    writes = {
        op
        for op in set(kept_in) | set(plain_in) | set(kept_out) | set(plain_out)
        if op != "AssignVariableOp"
        and (op.startswith("Assign") or op.startswith("ResourceScatter"))
    }
    assert writes, "no variable writes found in the traced step"
    for op in writes:
        assert kept_in[op] == plain_in[op] > 0 and kept_out[op] == plain_out[op] == 0, op
    # The forward and backward pass too: the lookup and the head's products.
    for op in ("GatherV2", "MatMul"):
        assert kept_out[op] == plain_out[op] == 0, op
        assert kept_in[op] == plain_in[op] > 0, op


OPTIMIZERS = {
    "adam": lambda lr: keras.optimizers.Adam(lr),
    "adamw": lambda lr: keras.optimizers.AdamW(lr),
    "sgd_momentum": lambda lr: keras.optimizers.SGD(lr, momentum=0.5),
    "loss_scale_adam": lambda lr: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(lr)),
}


@pytest.mark.backends("tensorflow", reason="XLA's sparse slots")
@pytest.mark.parametrize(
    "optimizer, keep_every, jit_compile, dense",
    [
        ("adam", 1, True, True),
        pytest.param("adamw", 1, True, True, marks=pytest.mark.slow),
        # Kept every other step: the write is conditional, XLA cannot share
        # the sum with the update, so rows.
        ("adam", 2, True, False),
        ("adam", 1, False, False),  # without XLA: rows, for any optimizer
        # Momentum densifies -lr * g, not g; the loss-scale optimizer's
        # update is inside a conditional: rows.
        ("sgd_momentum", 1, True, False),
        pytest.param("loss_scale_adam", 1, True, False, marks=pytest.mark.slow),
    ],
)
def test_under_xla_a_gradient_the_update_densifies_anyway_is_kept_dense(
    optimizer, keep_every, jit_compile, dense
):
    # Keras's Adam turns the sparse gradient into the table-sized tensor
    # anyway, so under XLA the slot is dense and written inside the compiled
    # step (XLA computes the sum once for both). The values read are the
    # same either way.
    ids = np.array([[1, 1, 3], [0, 1, 4], [2, 2, 2]], dtype="int32")
    y = np.zeros((3, 1), "float32")
    model = _embedding_net(
        OPTIMIZERS[optimizer](0.0),
        compile_options={"jit_compile": jit_compile},
        keep_every=keep_every,
    )
    model.fit(ids, y, batch_size=2, shuffle=False, verbose=0)

    slot = model._keeper._slots["emb/embeddings"]
    if dense:
        assert slot.indices is None and slot.values.shape == (5, 2)
        assert not model._keeper.has_sparse_slots()
    else:
        assert slot.indices is not None
    kept = model.gradients["emb"]["embeddings"]
    # As in the tests above: step 2 ([2, 2, 2]) gives 36 to id 2; with
    # keep_every=2 only step 1 is kept: 6 per occurrence of ids 1, 1, 3, 0, 1, 4.
    if keep_every == 1:
        expected = [0.0, 0.0, 36.0, 0.0, 0.0]
    else:
        expected = [6.0, 18.0, 0.0, 6.0, 6.0]
    np.testing.assert_array_equal(kept[:, 0], expected)
    np.testing.assert_array_equal(kept[:, 1], expected)
    # Tracing the update to look at it ran none: two steps, weights as set.
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2
    np.testing.assert_array_equal(model.get_layer("emb").embeddings.numpy(), np.ones((5, 2)))

    # With a real learning rate, the model trains as plain Keras does.
    kept, plain = _embedding_pair(
        lambda: OPTIMIZERS[optimizer](0.1), {"jit_compile": jit_compile}, keep_every=keep_every
    )
    for model in (kept, plain):
        model.fit(ids, y, batch_size=2, shuffle=False, verbose=0)
    for a, b in zip(kept.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(kept.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


class CountingAdam(keras.optimizers.Adam):
    """Adam that creates a variable in its first update, not in `build`,
    and counts the variable updates in it."""

    def update_step(self, gradient, variable, learning_rate):
        if not hasattr(self, "updates_made"):
            self.updates_made = self.add_variable((), name="updates_made")
        self.updates_made.assign_add(1.0)
        super().update_step(gradient, variable, learning_rate)


@pytest.mark.backends("tensorflow", reason="XLA's sparse slots")
@pytest.mark.slow  # XLA compiles two models
def test_an_update_that_creates_variables_is_traced_for_the_slots_and_runs_as_in_keras():
    # Under XLA the slots of sparse gradients are made once the optimizer's
    # update is traced (to see whether Adam densifies them). An optimizer
    # that creates a variable in its update still counts only the real
    # updates and trains as in plain Keras.
    ids = np.array([[1, 1, 3], [0, 1, 4], [2, 2, 2]], dtype="int32")
    y = np.zeros((3, 1), "float32")
    kept, plain = _embedding_pair(lambda: CountingAdam(0.1), {"jit_compile": True})
    for model in (kept, plain):
        model.fit(ids, y, batch_size=2, shuffle=False, verbose=0)
    assert kept._keeper._slots["emb/embeddings"].indices is None  # dense: traced
    # 2 steps x 2 variables (the table and the head's kernel).
    assert float(kept.optimizer.updates_made.numpy()) == 4.0
    assert float(plain.optimizer.updates_made.numpy()) == 4.0
    for a, b in zip(kept.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Adam's first step moves every weight with a gradient by -0.1: rows
    # 0, 1, 3, 4 and the head's kernel to 0.9, row 2 stays 1. Step 2's ids
    # [2, 2, 2] then output 6 * 0.9 = 5.4, d(loss)/d(output) = 10.8, and
    # id 2 gets 3 * 10.8 * 0.9 = 29.16 per component.
    np.testing.assert_allclose(
        kept.gradients["emb"]["embeddings"][:, 0], [0.0, 0.0, 29.16, 0.0, 0.0], rtol=1e-5
    )


@pytest.mark.backends(
    "tensorflow", reason="TensorFlow graph analysis (IndexedSlices densified under XLA)"
)
def test_densified_in_finds_the_conversion_of_exactly_that_gradient():
    def table(path):
        return types.SimpleNamespace(shape=(5, 2), path=path)

    graph = tf.Graph()
    with graph.as_default():
        values = tf.compat.v1.placeholder(tf.float32, (None, 2))
        indices = tf.compat.v1.placeholder(tf.int32, (None,))
        whole = tf.IndexedSlices(values, indices, tf.constant([5, 2]))
        scaled = tf.IndexedSlices(values * 2.0, indices, tf.constant([5, 2]))
        grads = [tf.ones(()), whole, scaled]
        variables = [table("bias"), table("whole"), table("scaled")]
        # Row-wise use, or a sum into another number of rows, densifies nothing.
        tf.reduce_sum(whole.values) + tf.reduce_sum(scaled.values)
        tf.math.unsorted_segment_sum(values, indices, 7)
        assert tf_xla.densified_in(graph, grads, variables) == set()
        # A conversion to a dense tensor, as Keras's Adam makes, of `scaled`.
        tf.convert_to_tensor(scaled) - tf.ones((5, 2))
        assert tf_xla.densified_in(graph, grads, variables) == {"scaled"}
        tf.math.unsorted_segment_sum(values, indices, 5)
        assert tf_xla.densified_in(graph, grads, variables) == {"whole", "scaled"}


# --- keep_gradients=False and what is not saved --------------------------


def test_off_is_a_plain_keras_model():
    off = one_weight(keep_gradients=False)
    plain = one_weight(cls=keras.Model)
    for model in (off, plain):
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, verbose=0)

    def described(variables):
        return [(v.name, tuple(v.shape), v.dtype) for v in variables]

    assert [v.path for v in off.variables] == [v.path for v in plain.variables]
    assert described(off.optimizer.variables) == described(plain.optimizer.variables)
    assert len(off.optimizer.variables) == 4  # iteration, lr, momentum, velocity
    for a, b in zip(off.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert off.kept_step is None
    with pytest.raises(AttributeError, match="keep_gradients=True"):
        off.gradients


@pytest.mark.backends("tensorflow", reason="counts the ops of a tf.function graph")
def test_off_traces_exactly_the_ops_of_a_plain_model():
    def op_count(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, verbose=0)  # builds everything
        spec = (tf.TensorSpec((2, 1)), tf.TensorSpec((2, 1)))
        graph = tf.function(model.train_step).get_concrete_function(spec).graph
        return sorted(op.type for op in graph.get_operations())

    plain = op_count(one_weight(cls=keras.Model))
    assert op_count(one_weight(keep_gradients=False)) == plain
    # And keeping adds exactly one write for the one variable.
    kept = op_count(one_weight())
    assert len(kept) > len(plain)
    assert kept.count("AssignVariableOp") == plain.count("AssignVariableOp") + 1

    # The whole training function Keras runs (its loop, the step, every
    # function they call), without and with XLA: also the same ops.
    dataset = tf.data.Dataset.from_tensors((X, Y))
    for jit_compile in (False, True):
        counts = []
        for model in (one_weight(cls=keras.Model), one_weight(keep_gradients=False)):
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
            model.fit(dataset, shuffle=False, verbose=0)
            counts.append(_ops_inside_and_outside_xla(model, dataset))
        assert counts[0] == counts[1]
        inside, outside = counts[0]
        # The step was walked: its one-weight update, inside XLA or not.
        assert (inside if jit_compile else outside)["AssignSubVariableOp"] >= 1


@pytest.mark.backends("tensorflow", reason="orders the ops of a tf.function graph")
@pytest.mark.parametrize("kind", ["dense", "embedding", "keep_every"])
def test_each_update_comes_after_its_slot_write(kind):
    # The optimizer's update of a variable reads the gradient after its slot
    # write (the order that measured one extra buffer in peak memory, not up
    # to two; see `_keeper.after`). A sparse slot is written as values and
    # indices; with keep_every the writes sit in one conditional.
    if kind == "embedding":
        inputs = keras.Input((2,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(5, 3, name="a")(inputs))
        x = np.array([[1, 2], [2, 3]], "int32")
    else:
        inputs = keras.Input((2,))
        hidden = keras.layers.Dense(3, name="a")(inputs)
        x = np.ones((2, 2), "float32")
    options = dict(keep_every=2) if kind == "keep_every" else {}
    model = kg.KeepGradModel(inputs, keras.layers.Dense(1, name="b")(hidden), **options)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, np.zeros((2, 1)), verbose=0)
    spec = (tf.TensorSpec((2, 2), x.dtype), tf.TensorSpec((2, 1)))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    captured = {id(outer): inner.op for outer, inner in graph.captures}

    def writers(variable):
        """The ops that take `variable`'s handle, other than plain reads."""
        variable = variable.value if isinstance(variable, keras.Variable) else variable
        handle = captured[id(variable.handle)].outputs[0]
        return [op for op in handle.consumers() if op.type != "ReadVariableOp"]

    def ancestors(op):
        seen, stack = set(), [op]
        while stack:
            current = stack.pop()
            for parent in [t.op for t in current.inputs] + list(current.control_inputs):
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return seen

    slots = model._keeper._slots
    for variable in model.trainable_variables:
        slot = slots[variable.path]
        writes = writers(slot.values)
        if slot.indices is not None:
            writes += writers(slot.indices)
        if kind == "keep_every":
            expected = ["If"]
        elif variable.path == "a/embeddings":
            expected = ["AssignVariableOp"] * 2  # values and indices
        else:
            expected = ["AssignVariableOp"]
        assert [w.type for w in writes] == expected, variable.path
        (update,) = writers(variable)
        assert set(writes) <= ancestors(update), variable.path


def test_kept_gradients_are_not_weights():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert len(model.weights) == 1 and len(model.get_weights()) == 1
    model.set_weights([np.array([[2.0]], dtype="float32")])
    np.testing.assert_array_equal(kernel(model), [[15.0]])  # untouched


def test_keep_gradients_off_is_plain_keras_and_can_be_turned_on():
    model = one_weight(keep_gradients=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert float(model.get_weights()[0][0, 0]) == 1.5
    with pytest.raises(AttributeError, match="keep_gradients=True"):
        model.gradients
    model.keep_gradients = True
    model.fit(X, Y, batch_size=2, verbose=0)
    assert float(kernel(model)[0, 0]) == 7.5  # 5w at w = 1.5


def test_evaluate_and_predict_leave_the_kept_gradients():
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert model.evaluate(X, Y, verbose=0) == pytest.approx(5.625)  # mean(1.5^2, 3^2)
    assert model.predict(X, verbose=0).tolist() == [[1.5], [3.0]]
    assert float(kernel(model)[0, 0]) == 15.0


@pytest.mark.backends("tensorflow", reason="tf.train.Checkpoint")
def test_kept_gradients_are_not_checkpointed(tmp_path):
    model = one_weight()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert not [n for n in names if "kept_gradient" in n]
    plain = one_weight(cls=keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(X, Y, batch_size=2, verbose=0)
    plain_path = tf.train.Checkpoint(model=plain).write(str(tmp_path / "plain"))
    assert len(names) == len(tf.train.list_variables(plain_path))


# --- construction --------------------------------------------------------


@pytest.mark.backends(
    "tensorflow", reason="fresh processes: a slow check kept out of the per-backend runs"
)
@pytest.mark.slow  # fresh processes
def test_functional_and_subclassing_work_in_both_orders():
    functional = """
        inputs = keras.Input((1,))
        f = kg.KeepGradModel(inputs, keras.layers.Dense(1)(inputs))
        assert isinstance(f, kg.KeepGradModel) and isinstance(f, keras.Model)
    """
    subclass = """
        class Net(kg.KeepGradModel):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.d = keras.layers.Dense(1)
            def call(self, x):
                return self.d(x)
        n = Net()
        n.compile(optimizer="sgd", loss="mse")
        n.fit(np.ones((2, 1)), np.zeros((2, 1)), verbose=0)
        assert n.gradients
    """
    functional_subclass = """
        class FNet(kg.KeepGradModel):
            def __init__(self, **kw):
                inputs = keras.Input((1,))
                super().__init__(inputs, keras.layers.Dense(1)(inputs), **kw)
        fn = FNet()
        fn.compile(optimizer="sgd", loss="mse")
        fn.fit(np.ones((2, 1)), np.zeros((2, 1)), verbose=0)
        assert fn.gradients and isinstance(fn, kg.KeepGradModel)
    """
    # Keras's Functional constructor may swap a class's bases; ours stay put.
    head = (
        "import keras, numpy as np\nimport keras_keepgrad as kg\n"
        "bases = kg.KeepGradModel.__bases__\n"
        "assert keras.Model in bases\n"
    )
    for order in (
        [functional, subclass, functional_subclass, subclass],
        [subclass, functional_subclass, functional, subclass],
    ):
        code = head + "".join(textwrap.dedent(part) for part in order)
        code += "\nassert kg.KeepGradModel.__bases__ == bases\nprint('ok')\n"
        result = run_py(code)
        assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_keep_gradients_shares_the_original_variables(kind):
    if kind == "sequential":
        original = keras.Sequential([keras.Input((1,)), dense_0()])
    elif kind == "functional":
        inputs = keras.Input((1,))
        original = keras.Model(inputs, dense_0()(inputs))
    else:

        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.d = dense_0()

            def call(self, x, training=None):
                return self.d(x)

        original = Net()
    model = kg.keep_gradients(original)
    assert isinstance(model, kg.KeepGradModel) and model.keep_gradients
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    np.testing.assert_array_equal(original.get_weights()[0], [[1.5]])
    flat = model.get_gradients_by_path()
    assert list(flat) == [v.path for v in original.trainable_variables]
    np.testing.assert_array_equal(list(flat.values())[0], [[15.0]])


def test_a_wrapped_model_shows_its_layers_and_adds_no_name_scope():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.d = dense_0()
            self.units = 1

        def call(self, x):
            return self.d(x)

    original = Net()  # unbuilt: the wrapper's first call builds it
    model = kg.keep_gradients(original)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert [v.path for v in model.weights] == ["net/dense_0/kernel"]
    assert model.d is original.d and model.layers == [original.d]
    assert model.get_layer("dense_0") is original.d
    # Public attributes are read through, private ones only if saveable:
    # Keras probes private ones with `hasattr`, e.g. the compile config that
    # the original (compiled here) has and an uncompiled wrapper has not.
    assert model.units == 1
    bare = kg.keep_gradients(original)
    original.compile(optimizer="sgd", loss="mse")
    assert hasattr(original, "_compile_config")
    match = "'WrappedKeepGradModel' object has no attribute '_compile_config'"
    with pytest.raises(AttributeError, match=match):
        bare._compile_config
    assert bare.get_compile_config() == {} and original.get_compile_config()
    assert {"d", "units"} <= set(dir(model)) and "model" not in dir(model)


def test_a_wrapper_keeps_its_own_training_state_and_property_errors():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.d = dense_0()

        def call(self, x):
            return self.d(x)

    original = Net()
    bare = kg.keep_gradients(original)  # neither is compiled
    original.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    original.fit(X, Y, batch_size=2, verbose=0)
    # What Keras sets on the original as it trains it is not the wrapper's.
    for name in ("optimizer", "history", "stop_training"):
        assert hasattr(original, name) and not hasattr(bare, name), name

    # A compiled original: the wrapper gets the same optimizer object, as
    # its own; compiling the original again does not change the wrapper's.
    kept = kg.keep_gradients(original)
    sgd = original.optimizer
    original.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    assert kept.optimizer is sgd
    kept.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5 -> 0.75, gradient 7.5
    assert int(sgd.iterations) == 2
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(original.d.kernel), [[0.75]])

    # A property of the wrapper that raises keeps its message.
    off = kg.keep_gradients(Net(), keep_gradients=False)
    with pytest.raises(AttributeError, match="Model 'net' does not keep gradients"):
        off.gradients


def test_keep_gradients_warns_about_step_methods_it_will_not_run():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = dense_0()

        def call(self, x):
            return self.d(x)

        def compute_loss(self, *args, **kwargs):
            return 2.0 * super().compute_loss(*args, **kwargs)

    match = (
        r"keep_gradients\(\): Net overrides \['compute_loss'\], "
        r"which the returned model does not run"
    )
    with pytest.warns(UserWarning, match=match):
        model = kg.keep_gradients(Net())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    (grad,) = model.get_gradients_by_path().values()
    np.testing.assert_array_equal(grad, [[15.0]])  # not 2 * 15
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kg.keep_gradients(one_weight(cls=keras.Model))  # Keras's own steps


def test_keep_gradients_carries_over_compile_and_optimizer_state():
    original = one_weight(cls=keras.Model)
    original.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    original.fit(X, Y, batch_size=2, verbose=0)  # w = 1.5
    model = kg.keep_gradients(original, save_gradients=True)
    assert model.optimizer is original.optimizer and model.save_gradients
    model.fit(X, Y, batch_size=2, verbose=0)
    np.testing.assert_array_equal(kernel(model), [[7.5]])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 2


def test_options_are_stored_and_in_get_config():
    model = one_weight(keep_gradients=False, save_gradients=True)
    config = model.get_config()
    assert config["keep_gradients"] is False and config["save_gradients"] is True
    assert model.keep_gradients is False and model.save_gradients is True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keep_gradients="yes"), r"`keep_gradients` must be a bool.*keep_gradients='yes'"),
        (dict(keep_gradients=1), r"`keep_gradients` must be a bool.*keep_gradients=1 of type int"),
        (dict(save_gradients=None), r"`save_gradients` must be a bool.*save_gradients=None"),
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    with pytest.raises(TypeError, match=match):
        one_weight(**kwargs)
    with pytest.raises(TypeError, match=match):
        kg.keep_gradients(one_weight(cls=keras.Model), **kwargs)


def test_keep_gradients_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match=r"`model` must be a `keras.Model`.*Dense"):
        kg.keep_gradients(keras.layers.Dense(1))
    with pytest.raises(TypeError, match=r"unknown options \['keep_grads'\]"):
        kg.keep_gradients(one_weight(cls=keras.Model), keep_grads=True)


def test_other_backends_are_refused_with_a_clear_error(monkeypatch):
    # The check reads the backend through `keras.backend.backend()`; the
    # error names the backends that work.
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    match = (
        r"requires the TensorFlow, the JAX or the PyTorch backend.*"
        r"KERAS_BACKEND='numpy'.*KERAS_BACKEND=tensorflow, KERAS_BACKEND=jax "
        r"or KERAS_BACKEND=torch"
    )
    with pytest.raises(RuntimeError, match=match):
        one_weight()
    monkeypatch.undo()
    plain = one_weight(cls=keras.Model)
    monkeypatch.setattr(keras.backend, "backend", lambda: "openvino")
    with pytest.raises(RuntimeError, match=match.replace("numpy", "openvino")):
        kg.keep_gradients(plain)


@pytest.mark.backends(
    "tensorflow", reason="a subprocess under KERAS_BACKEND=numpy, whatever this run's backend"
)
def test_importing_on_another_backend_is_refused_with_the_same_error():
    result = run_py("import keras_keepgrad", env={"KERAS_BACKEND": "numpy"})
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "RuntimeError: keras_keepgrad requires the TensorFlow, the JAX or the "
        "PyTorch backend of Keras. Received: KERAS_BACKEND='numpy'."
    ), result.stderr[-2000:]


@pytest.mark.not_compiled_on_torch(
    reason="torch_backend's test_keep_every_holds_its_copy_through_in_place_zeroing"
)
def test_keep_every_writes_steps_1_3_5_and_holds_between(mode):
    model = one_weight(keep_every=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    rec = fit_batches(model, 5)
    # 5w at w = 3, 1.5, 0.75, 0.375, 0.1875; only steps 1, 3, 5 are written.
    assert rec.seen == [15.0, 15.0, 3.75, 3.75, 0.9375]
    assert model.get_config()["keep_every"] == 2


@pytest.mark.not_compiled_on_torch(
    reason="the steps one by one: test_keep_every_writes_steps_1_3_5_and_holds_between"
)
@pytest.mark.parametrize("keep_every", [1, 2])
def test_kept_step_says_which_step_the_slots_hold(mode, keep_every):
    model = one_weight(keep_every=keep_every)
    assert model.kept_step is None  # before the first step
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(model.kept_step)
    )
    fit_batches(model, 4, callbacks=[record])
    assert [kept.paths for kept in seen] == [("dense_0/kernel",)] * 4
    if keep_every == 1:
        assert [(kept.write, kept.age) for kept in seen] == [(None, 0)] * 4
    else:
        # Steps 1 and 3 write the slots: steps 2 and 4 hold the one before.
        assert [kept.age for kept in seen] == [0, 1, 0, 1]
        writes = [kept.write for kept in seen]
        assert writes[0] == writes[1] != writes[2] == writes[3]
    model.keep_gradients = False
    assert model.kept_step is None


def test_kept_step_of_a_step_that_keeps_nothing_has_no_paths():
    model = one_weight(cls=UpdatesByHand)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert model.kept_step == ((), None, 0)
    assert float(model.get_weights()[0][0, 0]) == 1.5  # halved by hand


def test_keep_every_takes_a_numpy_int_and_stores_an_int():
    model = one_weight(keep_every=np.int64(2))
    assert model.keep_every == 2 and type(model.keep_every) is int
    model.keep_every = np.int32(3)
    assert model.get_config()["keep_every"] == 3
    assert type(model.get_config()["keep_every"]) is int


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", np.int64(0)])
def test_bad_keep_every_is_rejected(value):
    match = r"`keep_every` must be a positive int.*Received: keep_every="
    with pytest.raises(ValueError, match=match):
        one_weight(keep_every=value)


def test_dict_outputs_keep_each_heads_gradient():
    inputs = keras.Input((1,))
    outputs = {"a": dense_0(name="a")(inputs), "b": dense_0(name="b", w=1.0)(inputs)}
    model = kg.KeepGradModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mse"})
    model.fit(X, {"a": Y, "b": Y}, batch_size=2, verbose=0)
    assert list(model.get_gradients_by_path()) == ["a/kernel", "b/kernel"]
    # Total loss = mse_a + mse_b: each head's gradient is its own 5w.
    np.testing.assert_array_equal(model.gradients["a"]["kernel"], [[15.0]])
    np.testing.assert_array_equal(model.gradients["b"]["kernel"], [[5.0]])


@pytest.mark.parametrize("compiled_first", [False, True])
def test_keep_gradients_keeps_dict_inputs_and_outputs_nested(compiled_first):
    # Output keys differ from the layer names: a model rebuilt from the flat
    # `inputs` / `outputs` lists would predict a list and refuse the dict loss.
    a, b = keras.Input((1,), name="in_a"), keras.Input((1,), name="in_b")
    total = keras.layers.Add()([a, b])
    outputs = {"y1": dense_0(name="out1")(total), "y2": dense_0(name="out2", w=1.0)(total)}
    plain = keras.Model({"in_a": a, "in_b": b}, outputs)
    loss = {"y1": "mse", "y2": "mse"}
    if compiled_first:
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    model = kg.keep_gradients(plain)
    if not compiled_first:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    # in_a + in_b = x: the one-weight problem of `X`, `Y` for each head.
    x = {"in_a": X / 2, "in_b": X / 2}
    predicted = model.predict(x, verbose=0)
    assert sorted(predicted) == ["y1", "y2"]
    np.testing.assert_array_equal(predicted["y1"], [[3.0], [6.0]])
    history = model.fit(x, {"y1": Y, "y2": Y}, batch_size=2, verbose=0).history
    assert sorted(history) == ["loss", "y1_loss", "y2_loss"]
    np.testing.assert_array_equal(model.gradients["out1"]["kernel"], [[15.0]])
    np.testing.assert_array_equal(model.gradients["out2"]["kernel"], [[5.0]])


def test_keep_gradients_of_a_one_input_model_takes_one_tensor(recwarn):
    # Rebuilt from `inputs == [x]`, the model would warn that a bare tensor
    # does not match its list of one input.
    inputs = keras.Input((1,))
    for plain in (
        keras.Model(inputs, dense_0()(inputs)),
        keras.Sequential([keras.Input((1,)), dense_0()]),
    ):
        model = kg.keep_gradients(plain)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(X)), [[3.0], [6.0]])
    # But for NumPy 2's about torch's `__array__`, met converting the output
    # (a third-party warning, ignored in pyproject.toml).
    messages = [str(w.message) for w in recwarn]
    assert [m for m in messages if "__array__ implementation" not in m] == []


def test_layers_sharing_a_name_get_a_clear_error_not_a_lost_gradient():
    # Keras trains two layers both named "d"; their variables share a path,
    # the key of the kept gradients, so one of them would be lost.
    class Net(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(name="net", **kwargs)
            self.first = keras.layers.Dense(2, name="d")
            self.second = keras.layers.Dense(2, name="d")

        def call(self, x):
            return self.first(x) + self.second(x)

    x, y = np.ones((2, 2), "float32"), np.zeros((2, 2), "float32")
    model = Net()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match="share the paths 'net/d/bias', 'net/d/kernel'"):
        model.fit(x, y, verbose=0)
    assert int(model.optimizer.iterations) == 0  # nothing was trained
    off = Net(keep_gradients=False)
    off.compile(keras.optimizers.SGD(0.1), "mse")
    off.fit(x, y, verbose=0)
    assert int(off.optimizer.iterations) == 1


def test_a_model_with_nothing_trainable_keeps_an_empty_structure():
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1, name="d")
    dense.trainable = False
    model = kg.KeepGradModel(inputs, dense(inputs))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with no_warning_on_jax(UserWarning, match="does not have any trainable weights"):
        model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
    assert model.get_state_tree()["trainable_variables"] == {}
    assert model.gradients == {}
    assert model.get_gradients_by_path() == {}


@pytest.mark.backends("tensorflow", "torch", reason="a stateful test_step; JAX's is stateless")
def test_a_subclass_test_step_of_its_own_skips_the_gradient_metrics():
    # Keras's guide pattern for a custom `test_step`; the gradient metric
    # must skip it, as it skips `KeepGradModel.test_step`, not raise.
    class Net(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = dense_0()

        def call(self, x):
            return self.dense(x)

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self._loss_tracker.update_state(self.compute_loss(x=x, y=y, y_pred=y_pred))
            return self.compute_metrics(x, y, y_pred)

    model = Net()
    model.compile(keras.optimizers.SGD(0.0), "mse", metrics=[kg.metrics.GradientNorm()])
    history = model.fit(X, Y, batch_size=2, validation_data=(X, Y), verbose=0)
    # mean((w*x)^2) at w = 3, x = [1, 2]: d/dw = 5w = 15; val loss 9 * 2.5.
    assert history.history == {"grad_norm": [15.0], "loss": [22.5], "val_loss": [22.5]}
    assert model.evaluate(X, Y, verbose=0, return_dict=True) == {"loss": 22.5}


@keras.saving.register_keras_serializable(package="tests")
class _RegisteredNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = dense_0()

    def call(self, x):
        return self.d(x)


def test_clone_model_and_the_options_as_documented():
    options = dict(keep_gradients=False, save_gradients=True, keep_every=3)
    inputs = keras.Input((1,))
    functional = kg.KeepGradModel(inputs, dense_0()(inputs), **options)
    # Keras rebuilds a functional model from inputs, outputs and name alone.
    clone = keras.models.clone_model(functional)
    assert (clone.keep_gradients, clone.save_gradients, clone.keep_every) == (True, False, 1)
    # A wrapped (registered) subclassed model goes through `get_config`.
    clone = keras.models.clone_model(kg.keep_gradients(_RegisteredNet(name="net"), **options))
    assert (clone.keep_gradients, clone.save_gradients, clone.keep_every) == (False, True, 3)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(X)), [[3.0], [6.0]])

    class Unregistered(_RegisteredNet):
        pass

    with pytest.raises(TypeError, match="Could not locate class 'Unregistered'"):
        keras.models.clone_model(kg.keep_gradients(Unregistered(name="net")))
