"""Keeping from any training step: the user's own `train_step`, several
optimizers, updates without an optimizer, and the steps that keep nothing.

The numbers are the one-weight model's (conftest.py): w = 3, x = [[1], [2]],
y = 0, mse, so the gradient is 5w = 15 and SGD(0.1) makes w = 1.5.
"""

import warnings

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import W0
from conftest import X
from conftest import Y
from conftest import compiled_on_torch_only
from conftest import dense_0
from conftest import jax_mse_and_gradients
from conftest import keras_histogram_tag
from conftest import mse_gradients
from conftest import no_warning_on_jax
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad import _compat


def kernel(model, name="dense_0"):
    return float(model.gradients[name]["kernel"][0, 0])


def guide_metrics(model, loss, y, y_pred):
    """The guide's loop over `model.metrics`; returns their results."""
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in model.metrics}


class GuideStep(kg.KeepGradModel):
    """The first custom step of Keras's "Customizing what happens in fit()"
    guide: its own tape (PyTorch: `backward()`, as the guide's PyTorch
    version), `self.optimizer.apply`, the compiled loss, and a loop over
    `self.metrics`."""

    def train_step(self, data):
        x, y = data
        if keras.backend.backend() == "torch":
            import torch

            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            self.optimizer.scale_loss(loss).backward()
            trainable_weights = list(self.trainable_weights)
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            return guide_metrics(self, loss.detach(), y, y_pred.detach())
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(scaled, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        return guide_metrics(self, loss, y, y_pred)


GUIDE_BACKENDS = pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful step (JAX's own steps: jax_backend/)"
)


def guide_model(cls=GuideStep, dtype=None):
    inputs = keras.Input((1,))
    return cls(inputs, dense_0(dtype=dtype)(inputs))


@GUIDE_BACKENDS
@pytest.mark.not_compiled_on_torch(
    reason="an own step under torch.compile: torch_backend's "
    "test_own_torch_style_train_step_is_kept and, unscaled, "
    "test_loss_scale_optimizer_keeps_the_unscaled_gradient_once"
)
@pytest.mark.parametrize("optimizer", ["sgd", "loss_scale"])
def test_the_guides_own_step_keeps_5w(mode, optimizer):
    model = guide_model()
    opt = keras.optimizers.SGD(0.1)
    if optimizer == "loss_scale":
        # The step scales the loss itself (`optimizer.scale_loss`): kept
        # gradients are divided by the same scale, 1024.
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=1024.0)
    model.compile(optimizer=opt, loss="mse", metrics=[kg.metrics.GradientNorm(), "mae"], **mode)
    history = model.fit(
        np.tile(X, (2, 1)), np.tile(Y, (2, 1)), batch_size=2, epochs=1, shuffle=False, verbose=0
    )
    # Two steps: 5w at w = 3 then at w = 1.5; the norm metric averages them.
    assert history.history["grad_norm"] == [(15.0 + 7.5) / 2]
    assert kernel(model) == 7.5
    w = float(model.get_weights()[0][0, 0])
    assert w == 0.75  # 1.5 - 0.1 * 7.5: what the optimizer received, 7.5
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}


class GuideSteps:
    """The guide's steps on a mixin, before `KeepGradModel` in the bases."""

    train_step = GuideStep.train_step

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return guide_metrics(self, loss, y, y_pred)


class MixedInSteps(GuideSteps, kg.KeepGradModel):
    pass


@GUIDE_BACKENDS
def test_steps_from_a_mixin_keep_and_evaluate_as_the_classs_own():
    model = guide_model(MixedInSteps)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=[kg.metrics.GradientNorm()]
    )
    history = model.fit(X, Y, batch_size=2, verbose=0)
    assert history.history["grad_norm"] == [15.0]  # 5w at w = 3
    assert kernel(model) == 15.0
    # Evaluation skips the gradient metric, as for the class's own steps:
    # mse at w = 1.5 is 1.5^2 * 2.5.
    result = model.evaluate(X, Y, verbose=0, return_dict=True)
    if _compat.KERAS_VERSION < (3, 14):
        # Keras before 3.14 returns a custom step's logs as the step returned
        # them, nested and unconverted: the skipped metric's result is empty.
        assert result["compile_metrics"] == {"grad_norm": {}}
        result = {"loss": float(result["loss"])}
    assert result == {"loss": 5.625}


@GUIDE_BACKENDS
def test_the_guides_step_under_mixed_float16_keeps_unscaled_float32():
    keras.config.set_dtype_policy("mixed_float16")
    model = guide_model()
    # A scale small enough that the float16 forward values 3 x * scale stay
    # finite (Keras's default 32768 overflows them, and skips the step).
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    # float16 gradients divided by the float32 dynamic scale are float32.
    assert model.gradient_dtypes == {"dense_0/kernel": "float32"}
    assert kernel(model) == 15.0


class Holding(keras.Model):
    """A subclassed model that calls one layer."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.inner = layer

    def call(self, x):
        return self.inner(x)


def sub_model(kind, layer, name):
    """`layer` in a built sub-model `name`: "sequential", "functional" or
    "subclassed"."""
    if kind == "sequential":
        return keras.Sequential([keras.Input((1,)), layer], name=name)
    if kind == "functional":
        inputs = keras.Input((1,))
        return keras.Model(inputs, layer(inputs), name=name)
    model = Holding(layer, name=name)
    model(np.ones((1, 1), "float32"))  # builds `layer` in the model's name scope
    return model


GAN_BACKENDS = pytest.mark.backends(
    "tensorflow",
    "torch",
    reason="two optimizers in one step: Keras's JAX trainer carries one optimizer's state",
)


class OneWeightGAN(kg.KeepGradModel):
    """The DCGAN shape on one weight each: no `call()`, `compile` of its own
    taking two optimizers, two tapes, two `apply_gradients`.

    G(z) = g z and D(x) = d x, with d = 3, g = 2, real x = [[1], [2]] and
    z = [[1], [1]] (the data's second element, so that the step is exact).
    """

    def __init__(self, penalty=0.0, kind="sequential", **kwargs):
        super().__init__(**kwargs)
        self.penalty = penalty
        self.discriminator = sub_model(kind, dense_0(name="d"), "discriminator")
        self.generator = sub_model(kind, dense_0(name="g", w=2.0), "generator")
        # Its sub-models are built; without a `call()`, Keras's PyTorch
        # trainer could not build it from a batch.
        self.built = True

    def compile(self, d_optimizer, g_optimizer, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer

    def train_step(self, data):
        if keras.backend.backend() == "torch":
            return self._torch_step(data)
        real, z = data
        with tf.GradientTape() as tape:
            fake = self.generator(z)
            d_loss = tf.reduce_mean((self.discriminator(real) - 1.0) ** 2)
            d_loss += tf.reduce_mean(self.discriminator(fake) ** 2)
            if self.penalty:
                # WGAN-GP: the discriminator's input gradient on points
                # between real and fake, from an inner tape that no
                # optimizer sees.
                mixed = 0.5 * real + 0.5 * fake
                with tf.GradientTape() as inner:
                    inner.watch(mixed)
                    score = self.discriminator(mixed)
                slopes = tf.norm(inner.gradient(score, mixed), axis=1)
                d_loss += self.penalty * tf.reduce_mean((slopes - 1.0) ** 2)
        d_vars = self.discriminator.trainable_variables
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, d_vars), d_vars))
        with tf.GradientTape() as tape:
            g_loss = tf.reduce_mean((self.discriminator(self.generator(z)) - 1.0) ** 2)
        g_vars = self.generator.trainable_variables
        self.g_optimizer.apply(tape.gradient(g_loss, g_vars), g_vars)
        return {"d_loss": d_loss, "g_loss": g_loss}

    def _torch_step(self, data):
        # The same step with `torch.autograd.grad`, the penalty's input
        # gradient with `create_graph=True`.
        import torch

        real, z = data
        d_vars = self.discriminator.trainable_variables
        fake = self.generator(z)
        d_loss = torch.mean((self.discriminator(real) - 1.0) ** 2)
        d_loss = d_loss + torch.mean(self.discriminator(fake) ** 2)
        if self.penalty:
            mixed = (0.5 * real + 0.5 * fake).detach().requires_grad_(True)
            score = self.discriminator(mixed)
            (slopes,) = torch.autograd.grad(score.sum(), mixed, create_graph=True)
            slopes = torch.linalg.vector_norm(slopes, dim=1)
            d_loss = d_loss + self.penalty * torch.mean((slopes - 1.0) ** 2)
        d_grads = torch.autograd.grad(d_loss, [v.value for v in d_vars])
        with torch.no_grad():
            self.d_optimizer.apply_gradients(zip(d_grads, d_vars))
        g_vars = self.generator.trainable_variables
        g_loss = torch.mean((self.discriminator(self.generator(z)) - 1.0) ** 2)
        g_grads = torch.autograd.grad(g_loss, [v.value for v in g_vars])
        with torch.no_grad():
            self.g_optimizer.apply(g_grads, g_vars)
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


@GAN_BACKENDS
@pytest.mark.parametrize(
    "penalty", compiled_on_torch_only([0.0, 1.0], [1.0], reason="the 1.0 case")
)
def test_a_gan_keeps_what_each_of_its_optimizers_receives(mode, penalty):
    gan = OneWeightGAN(penalty=penalty)
    gan.compile(
        d_optimizer=keras.optimizers.SGD(0.03125),
        g_optimizer=keras.optimizers.SGD(0.5),
        **mode,
    )
    z = np.ones((2, 1), "float32")
    if keras.backend.backend() == "torch" and mode.get("jit_compile") and penalty:
        # `torch.compile` cannot differentiate a gradient (the penalty's),
        # whatever the model; the step fails before either update.
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            gan.fit(X, z, batch_size=2, verbose=0)
        weights = [gan.discriminator.get_weights()[0], gan.generator.get_weights()[0]]
        assert [float(w[0, 0]) for w in weights] == [3.0, 2.0]
        return
    gan.fit(X, z, batch_size=2, verbose=0)
    # D: mean(2 (d x - 1) x) + mean(2 d (g z)^2) = 2 mean(2, 10) + 6 * 4 = 36.
    # The penalty: every slope is |d| = 3, so (3 - 1)^2 and d/dd 2 (3 - 1) = 4.
    d_grad = 36.0 + 4.0 * penalty
    assert keras.ops.convert_to_numpy(gan.gradients["discriminator"]["d"]["kernel"]) == [[d_grad]]
    d_new = 3.0 - 0.03125 * d_grad  # 1.875, or 1.75 with the penalty
    assert float(gan.discriminator.get_weights()[0][0, 0]) == d_new
    # G, against the updated D: 2 (d' g - 1) d' at g = 2.
    g_grad = 2.0 * (2.0 * d_new - 1.0) * d_new  # 10.3125, or 8.75
    assert keras.ops.convert_to_numpy(gan.gradients["generator"]["g"]["kernel"]) == [[g_grad]]
    assert float(gan.generator.get_weights()[0][0, 0]) == 2.0 - 0.5 * g_grad
    # One `model.gradients` for both optimizers, nothing else in it.
    assert sorted(gan.get_gradients_by_path()) == ["discriminator/d/kernel", "generator/g/kernel"]


def key_tree(nested):
    """`nested`'s dict structure, with None for its leaves."""
    return {k: key_tree(v) if isinstance(v, dict) else None for k, v in nested.items()}


@GAN_BACKENDS
@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_get_gradients_of_tells_a_gans_sub_models_apart(kind):
    gan = OneWeightGAN(kind=kind)
    gan.compile(d_optimizer=keras.optimizers.SGD(0.03125), g_optimizer=keras.optimizers.SGD(0.5))
    gan.fit(X, np.ones((2, 1), "float32"), batch_size=2, verbose=0)
    # A functional sub-model's variable paths do not hold its name, so its
    # layers are at the top level; Sequential and subclassed ones add theirs.
    if kind == "functional":
        expected = {"d": {"kernel": None}, "g": {"kernel": None}}
        d_path, g_path = "d/kernel", "g/kernel"
    else:
        expected = {
            "discriminator": {"d": {"kernel": None}},
            "generator": {"g": {"kernel": None}},
        }
        d_path, g_path = "discriminator/d/kernel", "generator/g/kernel"
    assert key_tree(gan.gradients) == key_tree(gan.get_state_tree()["trainable_variables"])
    assert key_tree(gan.gradients) == expected
    # As in the test above without the penalty: D receives 36, G 10.3125.
    d_grads = gan.get_gradients_of(gan.discriminator)
    g_grads = gan.get_gradients_of(gan.generator)
    assert {p: keras.ops.convert_to_numpy(g).tolist() for p, g in d_grads.items()} == {
        d_path: [[36.0]]
    }
    assert {p: keras.ops.convert_to_numpy(g).tolist() for p, g in g_grads.items()} == {
        g_path: [[10.3125]]
    }
    # A layer inside a sub-model, and the model itself.
    d_layer = gan.discriminator.layers[-1]
    assert list(gan.get_gradients_of(d_layer)) == [d_path]
    assert {p: float(g[0, 0]) for p, g in gan.get_gradients_of(gan).items()} == {
        d_path: 36.0,
        g_path: 10.3125,
    }


def functional(name, layer, w):
    """A functional sub-model `name` of one bias-free Dense(1) `layer` = w."""
    inputs = keras.Input((1,))
    return keras.Model(inputs, dense_0(name=layer, w=w)(inputs), name=name)


class TwoOptimizers(kg.KeepGradModel):
    """D(G(x)) with two functional sub-models, each updated by its own SGD
    in a step of the backend's own kind."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = functional("generator", "g", 3.0)
        self.discriminator = functional("discriminator", "d", 1.0)
        self.g_optimizer = keras.optimizers.SGD(0.1)
        self.d_optimizer = keras.optimizers.SGD(0.0625)

    def call(self, x):
        return self.discriminator(self.generator(x))

    def pairs(self):
        return [(self.g_optimizer, self.generator), (self.d_optimizer, self.discriminator)]

    def train_step(self, *args):
        backend = keras.backend.backend()
        if backend == "jax":
            return self._jax_step(*args)
        if backend == "torch":
            return self._torch_step(*args)
        x, y = args[0]
        loss, _, grads = mse_gradients(self, x, y)
        self._apply(grads)
        return {"loss": loss}

    def _apply(self, grads):
        position = {id(v): i for i, v in enumerate(self.trainable_variables)}
        for optimizer, sub in self.pairs():
            variables = sub.trainable_variables
            optimizer.apply([grads[position[id(v)]] for v in variables], variables)

    def _torch_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        loss = torch.mean((self(x) - y) ** 2)
        loss.backward()
        with torch.no_grad():
            self._apply([v.value.grad for v in self.trainable_variables])
        return {"loss": loss.detach()}

    def _jax_step(self, state, data):
        import jax
        import jax.numpy as jnp

        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data

        def loss_fn(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            return jnp.mean((y_pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        trainable = list(trainable)
        position = {id(v): i for i, v in enumerate(self.trainable_variables)}
        # SGD without momentum: no optimizer state to thread through.
        for optimizer, sub in self.pairs():
            at = [position[id(v)] for v in sub.trainable_variables]
            values, _ = optimizer.stateless_apply(
                [v.value for v in optimizer.variables],
                [grads[i] for i in at],
                [trainable[i] for i in at],
            )
            for i, value in zip(at, values):
                trainable[i] = value
        return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)


def test_get_gradients_of_two_functional_sub_models():
    gan = TwoOptimizers(name="gan")
    gan(X)
    for optimizer, sub in gan.pairs():
        optimizer.build(sub.trainable_variables)
    gan.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    gan.fit(X, Y, batch_size=2, verbose=0)
    # Functional sub-models add no level: their layers are at the top level,
    # as in Keras's own state tree.
    state = gan.get_state_tree()["trainable_variables"]
    assert {k: list(v) for k, v in gan.gradients.items()} == {"g": ["kernel"], "d": ["kernel"]}
    assert {k: list(v) for k, v in state.items()} == {"g": ["kernel"], "d": ["kernel"]}
    # loss = mean((d g x)^2): d/dg = 5 g d^2 = 15, d/dd = 5 d g^2 = 45.
    g_grads = gan.get_gradients_of(gan.generator)
    d_grads = gan.get_gradients_of(gan.discriminator)
    assert {p: float(g[0, 0]) for p, g in g_grads.items()} == {"g/kernel": 15.0}
    assert {p: float(g[0, 0]) for p, g in d_grads.items()} == {"d/kernel": 45.0}
    # Each optimizer applied its own: 3 - 0.1 * 15 and 1 - 45 / 16.
    assert float(gan.generator.get_weights()[0][0, 0]) == 1.5
    assert float(gan.discriminator.get_weights()[0][0, 0]) == -1.8125
    with pytest.raises(ValueError, match="'other' is not a layer of model 'gan'"):
        gan.get_gradients_of(functional("other", "o", 1.0))


def test_get_gradients_of_a_wrapped_models_layer():
    plain = sub_model("subclassed", dense_0(), "plain")
    kept = kg.keep_gradients(plain)
    kept.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    kept.fit(X, Y, batch_size=2, verbose=0)
    for layer in (plain.inner, plain, kept):
        assert {p: float(g[0, 0]) for p, g in kept.get_gradients_of(layer).items()} == {
            "plain/dense_0/kernel": 15.0
        }


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_get_gradients_of_refuses_what_it_cannot_answer():
    model = head_only()
    with pytest.warns(UserWarning, match="to any optimizer"):
        model.fit(X, Y, batch_size=2, verbose=0)
    assert {
        p: float(g[0, 0]) for p, g in model.get_gradients_of(model.get_layer("head")).items()
    } == {"head/kernel": 15.0}
    with pytest.raises(
        TypeError, match=r"pass `model.get_layer\('head'\)`. Received: layer='head'"
    ):
        model.get_gradients_of("head")
    with pytest.raises(
        ValueError, match=r"`layer` 'other' is not a layer of model .*none of its variables"
    ):
        model.get_gradients_of(one_weight(layer="other").layers[-1])
    with pytest.raises(ValueError, match=r"'unbuilt' has no variables.*not built yet"):
        model.get_gradients_of(dense_0(name="unbuilt"))
    with pytest.raises(
        ValueError, match=r"No gradient of `layer` 'body' was kept.*\['body/kernel'\]"
    ):
        model.get_gradients_of(model.get_layer("body"))

    inputs = keras.Input((1,))
    frozen = dense_0(name="frozen")
    frozen.trainable = False
    dropout = keras.layers.Dropout(0.5, name="dropout")  # its seed is a variable
    model = kg.KeepGradModel(inputs, dense_0()(dropout(frozen(inputs))))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    for layer in (frozen, dropout):
        with pytest.raises(ValueError, match=rf"{layer.name!r} has no trainable variables in"):
            model.get_gradients_of(layer)


@GAN_BACKENDS
def test_a_gans_gradients_reach_the_callbacks_and_agree_with_a_tape(tmp_path):
    gan = OneWeightGAN(penalty=1.0)
    gan.compile(d_optimizer=keras.optimizers.SGD(0.03125), g_optimizer=keras.optimizers.SGD(0.5))
    z = np.ones((2, 1), "float32")
    # An independent reference: the discriminator's loss on the same batch.
    d = tf.Variable(3.0)
    with tf.GradientTape() as tape:
        fake = 2.0 * z
        loss = tf.reduce_mean((d * X - 1.0) ** 2) + tf.reduce_mean((d * fake) ** 2)
        mixed = 0.5 * X + 0.5 * fake
        loss += tf.reduce_mean((tf.abs(d) * tf.ones_like(mixed) - 1.0) ** 2)
    reference = float(tape.gradient(loss, d))
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "s{step}.npz"), every=1)
    gan.fit(X, z, batch_size=2, verbose=0, callbacks=[snapshot])
    with np.load(tmp_path / "s1.npz") as saved:
        assert float(saved["discriminator/d/kernel"][0, 0]) == reference == 40.0
        assert float(saved["generator/g/kernel"][0, 0]) == 8.75


class AddLossDense(keras.layers.Layer):
    """y = w x, adding 0.5 w^2 to the loss (as a VAE adds its KL term)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(1, 1), initializer=keras.initializers.Constant(W0), name="kernel"
        )

    def call(self, x):
        self.add_loss(0.5 * keras.ops.sum(self.kernel**2))
        return keras.ops.matmul(x, self.kernel)


class VAEStep(kg.KeepGradModel):
    """A VAE-style step: the reconstruction loss plus `self.losses`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf.reduce_mean((y_pred - y) ** 2) + tf.add_n(self.losses)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@pytest.mark.parametrize(
    "own_step",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.backends(
                "tensorflow", reason="a train_step written with tf.GradientTape"
            ),
        ),
    ],
)
def test_add_loss_terms_are_in_the_kept_gradient(own_step):
    inputs = keras.Input((1,))
    outputs = AddLossDense(name="dense_0")(inputs)
    cls = VAEStep if own_step else kg.KeepGradModel
    model = cls(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=None if own_step else "mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    # d/dw [mean((w x)^2) + 0.5 w^2] = 5w + w = 18.
    assert kernel(model) == 18.0
    assert float(model.get_weights()[0][0, 0]) == pytest.approx(W0 - 0.1 * 18.0, rel=1e-6)


class HandUpdate(kg.KeepGradModel):
    """Updates its variables by hand, keeping the gradients it uses."""

    def __init__(self, *args, keep=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep = keep

    def train_step(self, data):
        x, y = data
        loss, variables, grads = mse_gradients(self, x, y)
        if self.keep:
            grads = self.keep_step_gradients(grads, variables)
        for variable, grad in zip(variables, grads):
            variable.assign_sub(0.1 * grad)
        return {"loss": loss}


def hand_update(keep=True):
    inputs = keras.Input((1,))
    return HandUpdate(inputs, dense_0()(inputs), keep=keep)


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
@pytest.mark.not_compiled_on_torch(
    reason="torch_backend's test_keep_step_gradients_without_optimizer"
)
def test_keep_step_gradients_keeps_an_update_without_an_optimizer(mode):
    model = hand_update()
    model.compile(loss="mse", **mode)
    model.fit(np.tile(X, (2, 1)), np.tile(Y, (2, 1)), batch_size=2, shuffle=False, verbose=0)
    assert kernel(model) == 7.5  # the second step's 5w at w = 1.5
    assert float(model.get_weights()[0][0, 0]) == 0.75


def test_keep_step_gradients_outside_a_training_step_raises():
    model = hand_update()
    variables = model.trainable_variables
    with pytest.raises(RuntimeError, match="call it from its `train_step`"):
        model.keep_step_gradients([np.ones((1, 1), "float32")], variables)
    with pytest.raises(RuntimeError, match="does not keep gradients"):
        inputs = keras.Input((1,))
        HandUpdate(inputs, dense_0()(inputs), keep_gradients=False).keep_step_gradients(
            [np.ones((1, 1), "float32")], variables
        )


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_a_step_that_keeps_nothing_says_so_everywhere(tmp_path):
    model = hand_update(keep=False)
    model.compile(loss="mse")
    snapshot = kg.callbacks.GradientSnapshot(str(tmp_path / "s{step}.npz"), every=1)
    with pytest.warns(UserWarning, match="passed no gradients to an optimizer") as seen:
        model.fit(
            np.tile(X, (2, 1)),
            np.tile(Y, (2, 1)),
            batch_size=2,
            verbose=0,
            shuffle=False,
            callbacks=[snapshot],
        )
    # Once, not at every step.
    assert len([w for w in seen if "passed no gradients" in str(w.message)]) == 1
    assert list(tmp_path.iterdir()) == []  # no file of placeholders
    with pytest.raises(RuntimeError, match="keep_step_gradients"):
        model.gradients
    # The update itself ran, as in a plain model: 3 - 0.1 * 15 - 0.1 * 7.5.
    assert float(model.get_weights()[0][0, 0]) == 0.75


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_tensorboard_and_the_monitor_write_nothing_for_a_step_that_keeps_nothing(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    model = hand_update(keep=False)
    model.compile(loss="mse")
    board = kg.callbacks.GradientTensorBoard(
        str(tmp_path), update_freq=1, histogram_freq=1, gradient_histogram_freq=1
    )
    monitor = kg.callbacks.GradientMonitor(exploding_threshold=1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=2, verbose=0, callbacks=[board, monitor])
    messages = [str(w.message) for w in seen if "nothing to read" in str(w.message)]
    assert [m.split(":")[0] for m in messages] == ["GradientTensorBoard", "GradientMonitor"]
    assert monitor.events == []
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    # Keras's own summaries and the layout, no gradient summary.
    assert sorted(acc.Tags()["tensors"]) == sorted(
        [
            "batch_loss",
            "custom_scalars__config__",
            keras_histogram_tag("dense_0/kernel"),
            "epoch_learning_rate",
            "epoch_loss",
        ]
    )


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_a_gradient_metric_in_a_step_that_keeps_nothing_raises():
    # The compiled metrics are updated without any kept gradient.
    class Updating(HandUpdate):
        def train_step(self, data):
            logs = super().train_step(data)
            self.compute_metrics(data[0], data[1], self(data[0]))
            return logs

    inputs = keras.Input((1,))
    model = Updating(inputs, dense_0()(inputs), keep=False)
    model.compile(loss="mse", metrics=[kg.metrics.GradientNorm()])
    with pytest.raises(ValueError, match="after `optimizer.apply"):
        model.fit(X, Y, batch_size=2, verbose=0)


class ConditionalApply(kg.KeepGradModel):
    """Applies its optimizer only on batches whose mean input exceeds 2,
    in a `tf.cond` (or, with `loop`, twice in a `tf.while_loop`)."""

    def __init__(self, *args, loop=False, helper=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop = loop
        self.helper = helper  # the condition in a `tf.function` of its own

    def train_step(self, data):
        x, y = data
        loss, variables, grads = mse_gradients(self, x, y)

        def apply(*_):
            self.optimizer.apply(grads, variables)
            return tf.constant(1)

        def condition():
            return tf.cond(keras.ops.mean(x) > 2.0, apply, lambda: tf.constant(0))

        if self.loop:
            tf.while_loop(lambda i: i < 2, lambda i: (apply() + i,), [tf.constant(0)])
        elif self.helper:
            tf.function(condition)()
        else:
            condition()
        return {"loss": loss}


@pytest.mark.backends("tensorflow", reason="tf.cond, tf.while_loop and tf.function in a step")
@pytest.mark.parametrize("kind, run_eagerly", [("cond", False), ("loop", False), ("helper", True)])
def test_an_optimizer_applied_under_traced_control_flow_is_refused(kind, run_eagerly):
    # "helper": an eager step whose `tf.function` holds the condition.
    inputs = keras.Input((1,))
    model = ConditionalApply(
        inputs, dense_0()(inputs), loop=kind == "loop", helper=kind == "helper"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=run_eagerly)
    with pytest.raises(RuntimeError, match=r"`SGD.apply` was called inside a `tf.cond`"):
        model.fit(X, Y, batch_size=2, verbose=0)
    np.testing.assert_array_equal(model.get_weights()[0], [[3.0]])  # no step ran


@pytest.mark.backends("tensorflow", reason="tf.cond in a step")
def test_a_conditional_apply_run_eagerly_keeps_the_steps_that_apply():
    inputs = keras.Input((1,))
    model = ConditionalApply(inputs, dense_0()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=True)
    seen = []

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            try:
                seen.append(kernel(self.model))
            except RuntimeError as error:
                seen.append("no optimizer" if "passed no gradients" in str(error) else error)

    # Batch means 1.5, 3.5, 1.5: only the second applies, at w = 3 and
    # x = [3, 4]: d/dw mean((w x)^2) = 2 w mean(x^2) = 6 * 12.5 = 75.
    x = np.concatenate([X, X + 2, X])
    model.fit(x, np.zeros((6, 1)), batch_size=2, shuffle=False, verbose=0, callbacks=[Read()])
    assert seen == ["no optimizer", 75.0, "no optimizer"]
    np.testing.assert_array_equal(model.get_weights()[0], [[3.0 - 0.1 * 75.0]])


class HeadOnly(kg.KeepGradModel):
    """Trains only its `head` layer with the optimizer."""

    def train_step(self, data):
        x, y = data
        head = [v for v in self.trainable_variables if "head" in v.path]
        loss, _, grads = mse_gradients(self, x, y, head)
        self.optimizer.apply(grads, head)
        return {"loss": loss}


def head_only(**options):
    inputs = keras.Input((1,))
    hidden = dense_0(name="body", w=1.0)(inputs)
    model = HeadOnly(inputs, dense_0(name="head")(hidden), **options)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_variables_no_optimizer_receives_are_absent_with_a_warning():
    model = head_only()
    with pytest.warns(UserWarning, match=r"\['body/kernel'\] to any optimizer"):
        model.fit(X, Y, batch_size=2, verbose=0)
    # d/dh mean((h b x)^2) = 2 h b^2 mean(x^2) = 2 * 3 * 2.5 = 15; no body entry.
    assert list(model.get_gradients_by_path()) == ["head/kernel"]
    assert kernel(model, "head") == 15.0


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_a_partly_kept_step_reaches_tensorboard_and_the_monitor(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    model = head_only()
    board = kg.callbacks.GradientTensorBoard(
        str(tmp_path), update_freq=1, gradient_histogram_freq=1
    )
    monitor = kg.callbacks.GradientMonitor(exploding_threshold=10.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*to any optimizer", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*exploding gradients", category=UserWarning)
        warnings.filterwarnings("ignore", message="GradientMonitor: summary", category=UserWarning)
        model.fit(X, Y, batch_size=2, verbose=0, callbacks=[board, monitor])
    # The head's 15 (see above) is all the step kept: layer, global norm,
    # the monitor's report; no panel for the body, which has no gradient.
    (event,) = monitor.events
    assert "global norm 15" in event["message"]
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    gradient_tags = sorted(t for t in acc.Tags()["tensors"] if "grad" in t)
    assert gradient_tags == [
        "gradients/heatmap",
        "gradients/log10_global_norm",
        "gradients/log10_norm/head",
        "gradients/nonfinite_steps",
        "head/kernel/gradient",
        "head/kernel/gradient_log10_abs",
    ]
    for tag in ("gradients/log10_norm/head", "gradients/log10_global_norm"):
        (value,) = acc.Tensors(tag)
        assert (value.step, float(tf.make_ndarray(value.tensor_proto))) == (
            1,
            float(np.float32(np.log10(15.0))),
        )
    # The layout's block charts would name the body: one layer, no blocks.
    (config,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tf.make_ndarray(config.tensor_proto).item())
    assert [c.title for c in layout.category] == ["Gradient panels"]


class Alternating(kg.KeepGradModel):
    """Eager: applies both layers on its first step, then only `a`."""

    def train_step(self, data):
        x, y = data
        loss, variables, grads = mse_gradients(self, x, y)
        both = int(keras.ops.convert_to_numpy(self.optimizer.iterations)) == 0
        pick = [i for i, v in enumerate(variables) if both or v.path.startswith("a/")]
        self.optimizer.apply([grads[i] for i in pick], [variables[i] for i in pick])
        return {"loss": loss}


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_steps_that_keep_different_layers_reach_tensorboard_each_as_kept(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    inputs = keras.Input((1,))
    hidden = dense_0(name="a", w=1.0)(inputs)
    model = Alternating(inputs, dense_0(name="b")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=True)
    board = kg.callbacks.GradientTensorBoard(str(tmp_path), update_freq=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*to any optimizer", category=UserWarning)
        model.fit(np.tile(X, (2, 1)), np.tile(Y, (2, 1)), batch_size=2, verbose=0,
                  shuffle=False, callbacks=[board])  # fmt: skip
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()

    def written(tag):
        return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]

    # loss = 2.5 a^2 b^2: d/da = 5 a b^2, d/db = 5 a^2 b. Step 1 at a = 1,
    # b = 3: 45 and 15, both applied (a = -3.5, b = 1.5). Step 2, a only:
    # 5 * -3.5 * 2.25 = -39.375.
    def log10(value):
        return float(np.float32(np.log10(value)))

    assert written("gradients/log10_norm/a") == [(1, log10(45.0)), (2, log10(39.375))]
    assert written("gradients/log10_norm/b") == [(1, log10(15.0))]
    assert written("gradients/log10_global_norm") == [
        (1, pytest.approx(np.log10(np.hypot(45.0, 15.0)), abs=1e-6)),
        (2, log10(39.375)),
    ]
    assert len(acc.Tensors("gradients/heatmap")) == 1  # drawn, of the steps since the change


@pytest.mark.backends(
    "tensorflow", "torch", reason="a stateful train_step (mse_gradients); JAX's steps are stateless"
)
def test_a_partly_kept_step_saves_its_gradients_by_variable_position(tmp_path):
    model = head_only(save_gradients=True)
    with pytest.warns(UserWarning, match="to any optimizer"):
        model.fit(X, Y, batch_size=2, verbose=0)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    with h5py.File(path) as f:
        group = f["_kept_gradients/vars"]
        assert list(group) == ["1:head%2Fkernel"]  # head is variable 1
        assert group["1:head%2Fkernel"][()].tolist() == [[15.0]]
    # Loading needs one gradient per trainable variable: it says so, and
    # changes nothing.
    with pytest.raises(ValueError, match="holds gradients for 1 variables"):
        model.load_weights(path)
    assert kernel(model, "head") == 15.0


def test_a_none_gradient_an_optimizer_receives_is_kept_as_zeros():
    class WithUnused(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = dense_0()
            self.unused = keras.layers.Dense(1, name="unused")

        def build(self, input_shape):
            self.dense.build(input_shape)
            self.unused.build(input_shape)

        def call(self, x):
            return self.dense(x)

    model = WithUnused(name="net")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with warnings.catch_warnings():
        # Keras warns that the optimizer got no gradient for `unused`.
        warnings.filterwarnings("ignore", message="Gradients do not exist")
        model.fit(X, Y, batch_size=2, verbose=0)
    grads = model.get_gradients_by_path()
    assert float(grads["net/dense_0/kernel"][0, 0]) == 15.0
    np.testing.assert_array_equal(grads["net/unused/kernel"], [[0.0]])


def test_nested_train_step_calls_are_one_step():
    class Calling(kg.KeepGradModel):
        def train_step(self, *args):
            return super().train_step(*args)

    inputs = keras.Input((1,))
    model = Calling(inputs, dense_0()(inputs), keep_every=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(np.tile(X, (3, 1)), np.tile(Y, (3, 1)), batch_size=2, shuffle=False, verbose=0)
    # Steps 1 and 3 written (w = 3, then 0.75), counted once per step.
    assert kernel(model) == 3.75


def out_model(w, name="out"):
    """`Input((1,)) -> Dense(1, name=name)` with kernel `w`, bias 0. A
    functional model's layers are built before it, so the paths are
    "out/kernel" and "out/bias" whatever the model's name."""
    inputs = keras.Input((1,))
    out = keras.layers.Dense(1, name=name, kernel_initializer=keras.initializers.Constant(w))
    return keras.Model(inputs, out(inputs))


class TwoOuts(kg.KeepGradModel):
    """Two sub-models with layers named `names`. `update`: "keras" (Keras's
    step), "one" optimizer for both, "two" (an SGD each), "keep" (by hand,
    through `keep_step_gradients`), in a step of the backend's own kind.

    y = w1 (w0 x + b0) + b1 with w0 = 3, w1 = 1, biases 0: the gradients
    are 5 w0 w1^2 = 15 and 5 w1 w0^2 = 45 for the kernels, 2 mean(3x) = 9
    for either bias."""

    def __init__(self, update, names=("out", "out"), **kwargs):
        super().__init__(**kwargs)
        self.update = update
        self.first = out_model(3.0, names[0])
        self.second = out_model(1.0, names[1])
        self.opt_a = keras.optimizers.SGD(0.1)
        self.opt_b = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, *args):
        if self.update == "keras":
            return super().train_step(*args)
        backend = keras.backend.backend()
        if backend == "jax":
            return self._jax_step(*args)
        if backend == "torch":
            return self._torch_step(*args)
        return self._tf_step(*args)

    def _tf_step(self, data):
        x, y = data
        loss, variables, grads = mse_gradients(self, x, y)
        self._update(grads, variables)
        return {"loss": loss}

    def _torch_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        loss = torch.mean((self(x) - y) ** 2)
        loss.backward()
        variables = self.trainable_variables
        with torch.no_grad():
            self._update([v.value.grad for v in variables], variables)
        return {"loss": loss.detach()}

    def _update(self, grads, variables):
        if self.update == "one":
            self.optimizer.apply(grads, variables)
        elif self.update == "two":
            self.opt_a.apply(grads[:2], variables[:2])
            self.opt_b.apply_gradients(zip(grads[2:], variables[2:]))
        else:
            for variable, grad in zip(variables, self.keep_step_gradients(grads, variables)):
                variable.assign(variable - 0.1 * grad)

    def _jax_step(self, state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data
        loss, grads = jax_mse_and_gradients(self, trainable, non_trainable, x, y)
        if self.update == "one":
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
        elif self.update == "two":
            # SGD without momentum: no optimizer state to thread through.
            halves = []
            for opt, part in ((self.opt_a, slice(0, 2)), (self.opt_b, slice(2, 4))):
                values, _ = opt.stateless_apply(
                    [v.value for v in opt.variables], grads[part], trainable[part]
                )
                halves.extend(values)
            trainable = halves
        else:
            grads = self.keep_step_gradients(grads, self.trainable_variables)
            trainable = [v - 0.1 * g for v, g in zip(trainable, grads)]
        return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)


def two_outs(update, names=("out", "out"), **compile_kwargs):
    model = TwoOuts(update, names)
    model(X)
    model.opt_a.build(model.first.trainable_variables)
    model.opt_b.build(model.second.trainable_variables)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return model


SHARED_OUT = r"share the paths 'out/bias', 'out/kernel': one .* distinct `name`s"


# The shared-path and colliding-path errors.
RAISED_IN_THE_KEEPING = pytest.mark.not_compiled_on_torch(
    reason="raised in the keeping, which runs eagerly under torch.compile: torch_backend's "
    "test_an_update_that_starts_writing_its_gradients_raises"
)


@RAISED_IN_THE_KEEPING
@pytest.mark.parametrize("update", ["keras", "one", "two", "keep"])
def test_variables_sharing_a_path_raise_before_anything_changes(mode, update):
    model = two_outs(update, **mode)
    with pytest.raises(ValueError, match=SHARED_OUT):
        model.fit(X, Y, batch_size=2, verbose=0)
    # Kernels 3 and 1, biases 0: nothing was updated.
    assert [w.tolist() for w in model.get_weights()] == [[[3.0]], [0.0], [[1.0]], [0.0]]
    optimizers = [model.optimizer, model.opt_a, model.opt_b]
    assert [int(keras.ops.convert_to_numpy(o.iterations)) for o in optimizers] == [0, 0, 0]

    # With distinct names the same step keeps all four gradients.
    model = two_outs(update, names=("a", "b"), **mode)
    model.fit(X, Y, batch_size=2, verbose=0)
    kept = {path: np.asarray(g).tolist() for path, g in model.get_gradients_by_path().items()}
    assert kept == {"a/kernel": [[15.0]], "a/bias": [9.0], "b/kernel": [[45.0]], "b/bias": [9.0]}


@pytest.mark.backends(
    "tensorflow",
    "torch",
    reason="a stateful train_step (mse_gradients); JAX's steps are stateless, and "
    "two optimizers' stateless_apply are checked by "
    "test_variables_sharing_a_path_raise_before_anything_changes",
)
@RAISED_IN_THE_KEEPING
def test_paths_that_collide_across_two_optimizers_raise(mode):
    # The second sub-model is not an attribute, so not the model's: its
    # paths meet the first's only at its optimizer. A traced step raises
    # as it is traced, before anything runs; a step that runs as it is
    # called (eager, and PyTorch's in every mode) puts back the first
    # optimizer's update before it raises.
    second = out_model(1.0)
    opt_b = keras.optimizers.SGD(0.1)

    class Untracked(kg.KeepGradModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = out_model(3.0)

        def call(self, x):
            return second(self.first(x))

        def train_step(self, data):
            x, y = data
            variables = self.first.trainable_variables + second.trainable_variables
            loss, variables, grads = mse_gradients(self, x, y, variables)
            self.optimizer.apply(grads[:2], variables[:2])
            opt_b.apply(grads[2:], variables[2:])
            return {"loss": loss}

    model = Untracked()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    with pytest.raises(ValueError, match=SHARED_OUT):
        model.fit(X, Y, batch_size=2, verbose=0)
    assert [w.tolist() for w in model.get_weights()] == [[[3.0]], [0.0]]
    assert [w.tolist() for w in second.get_weights()] == [[[1.0]], [0.0]]
    assert [int(o.iterations) for o in (model.optimizer, opt_b)] == [0, 0]


# --- what plain Keras trains, KeepGradModel trains alike --------------------


@pytest.mark.backends("tensorflow", reason="tf.distribute.MirroredStrategy")
def test_fit_inside_the_strategy_scope():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        inputs = keras.Input((1,))
        model = kg.KeepGradModel(inputs, dense_0()(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(X, Y, batch_size=2, verbose=0)
    assert kernel(model) == 15.0


def optional_input_model(cls):
    a = keras.Input((1,), name="a")
    b = keras.Input((1,), name="b", optional=True)

    class AddOptional(keras.layers.Layer):
        def call(self, a, b=None):
            return a if b is None else a + b

    out = dense_0()(AddOptional()(a, b))
    return cls({"a": a, "b": b}, out)


# Keras feeds None to an optional input from 3.12 on; earlier releases fail
# in their data adapters, on None's missing `shape`, plain Keras as
# KeepGradModel.
KERAS_FEEDS_NONE = _compat.KERAS_VERSION >= (3, 12)


@pytest.mark.parametrize("source", ["arrays", "generator"])
def test_an_optional_input_fed_none(source):
    def fit(model):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        if source == "arrays":
            model.fit({"a": X, "b": None}, Y, batch_size=2, verbose=0)
        else:

            def batches():
                while True:
                    yield {"a": X, "b": None}, Y

            model.fit(batches(), steps_per_epoch=1, shuffle=False, verbose=0)

    model = optional_input_model(kg.KeepGradModel)
    if KERAS_FEEDS_NONE:
        fit(model)
        assert kernel(model) == 15.0
        return
    errors = []
    for built in (optional_input_model(keras.Model), model):
        with pytest.raises(AttributeError) as error:
            fit(built)
        errors.append(str(error.value))
    assert errors == ["'NoneType' object has no attribute 'shape'"] * 2


def test_a_required_input_fed_none_raises_as_in_keras():
    errors = []
    for cls in (keras.Model, kg.KeepGradModel):
        a, b = keras.Input((1,), name="a"), keras.Input((1,), name="b")
        model = cls({"a": a, "b": b}, dense_0()(keras.layers.Add()([a, b])))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with pytest.raises(ValueError if KERAS_FEEDS_NONE else AttributeError) as error:
            model.fit({"a": X, "b": None}, Y, batch_size=2, verbose=0)
        errors.append(str(error.value))
    assert errors[0] == errors[1]


def test_legacy_h5_save_and_load(tmp_path):
    inputs = keras.Input((1,))
    model = kg.KeepGradModel(inputs, dense_0()(inputs), keep_every=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    path = str(tmp_path / "m.h5")
    model.save(path)
    # `compile=False`: Keras 3.15 cannot restore a compiled "mse" from a
    # legacy file for a plain model either.
    loaded = keras.saving.load_model(path, compile=False)
    assert type(loaded) is type(model)
    assert loaded.keep_every == 2
    np.testing.assert_array_equal(loaded.get_weights()[0], [[1.5]])


def test_nothing_trainable_logs_the_real_loss():
    losses = []
    for cls in (keras.Model, kg.KeepGradModel):
        inputs = keras.Input((1,))
        layer = dense_0()
        layer.trainable = False
        model = cls(inputs, layer(inputs))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            metrics=[kg.metrics.GradientNorm()] if cls is not keras.Model else [],
        )
        with no_warning_on_jax(UserWarning, match="does not have any trainable weights"):
            history = model.fit(X, Y, batch_size=2, verbose=0)
        losses.append(history.history["loss"])
    # mean((3 x)^2) = 9 * 2.5.
    assert losses == [[22.5], [22.5]]
    assert model.gradients == {}


def test_an_optimizer_class_defined_later_is_kept_once_at_its_own_apply():
    # Made after other models trained, with `apply` of its own that halves
    # the gradients before Keras's `apply`: the step handed it 5w = 15, and
    # that is what is kept (once, not again at the base class's `apply`).
    class Halving(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            return super().apply([0.5 * g for g in grads], trainable_variables)

    inputs = keras.Input((1,))
    model = kg.KeepGradModel(inputs, dense_0()(inputs))
    model.compile(optimizer=Halving(0.1), loss="mse")
    model.fit(X, Y, batch_size=2, verbose=0)
    assert kernel(model) == 15.0
    assert float(model.get_weights()[0][0, 0]) == 3.0 - 0.1 * 7.5


@GAN_BACKENDS
def test_a_gans_gradients_reach_tensorboard_and_the_monitor(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    gan = OneWeightGAN(penalty=1.0)
    gan.compile(d_optimizer=keras.optimizers.SGD(0.03125), g_optimizer=keras.optimizers.SGD(0.5))
    board = kg.callbacks.GradientTensorBoard(str(tmp_path), update_freq=1)
    monitor = kg.callbacks.GradientMonitor(exploding_threshold=30.0)
    z = np.ones((2, 1), "float32")
    with warnings.catch_warnings():
        # The monitor's own warning; its event is checked below.
        warnings.filterwarnings("ignore", message=".*exploding gradients", category=UserWarning)
        warnings.filterwarnings("ignore", message="GradientMonitor: summary", category=UserWarning)
        gan.fit(X, z, batch_size=2, verbose=0, callbacks=[board, monitor])
    (event,) = monitor.events
    assert (event["kind"], event["step"]) == ("exploding", 1)
    assert "global norm 40.95" in event["message"]
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    (event,) = acc.Tensors("gradients/log10_global_norm")
    # Both optimizers' gradients: sqrt(40^2 + 8.75^2), as log10.
    assert event.step == 1
    assert float(tf.make_ndarray(event.tensor_proto)) == pytest.approx(
        np.log10(np.hypot(40.0, 8.75)), abs=1e-6
    )
