"""The models and variants that `overhead.py` times, and how it runs steps."""

import collections
import time

import keras
import numpy as np
import tensorflow as tf
from overhead_models import conv as _conv
from overhead_models import embedding as _embedding
from overhead_models import mlp as _mlp

import keras_keepgrad as kg

VARIANTS = ("plain", "control", "kept", "every10", "hand", "floor", "recompute")


def model_specs(smoke):
    """`{name: (build, batch_size, make_x)}`; `make_x(rng, batch)` -> x."""
    if smoke:
        return {
            "mlp_1m": (_mlp(16, [32], 10), 8, lambda r, b: r.random((b, 16), "float32")),
            "embedding": (
                _embedding(100, 4, 5),
                8,
                lambda r, b: r.integers(0, 100, (b, 5)).astype("int32"),
            ),
        }
    return {
        # 512*1024 + 1024*512 + 512*10 (+ biases) = 1.06M parameters.
        "mlp_1m": (_mlp(512, [1024, 512], 10), 128, lambda r, b: r.random((b, 512), "float32")),
        # 1024*2048 + 2*2048*2048 + 2048*10 (+ biases) = 10.5M parameters.
        "mlp_10m": (
            _mlp(1024, [2048, 2048, 2048], 10),
            128,
            lambda r, b: r.random((b, 1024), "float32"),
        ),
        # CIFAR-sized: conv 32, conv 64, dense 128: 0.32M parameters.
        "conv": (_conv(32, [32, 64], 128), 64, lambda r, b: r.random((b, 32, 32, 3), "float32")),
        # Embedding(50_000, 64): 3.2M parameters, sparse gradient of
        # batch * length = 4096 rows.
        "embedding": (
            _embedding(50_000, 64, 64),
            64,
            lambda r, b: r.integers(0, 50_000, (b, 64)).astype("int32"),
        ),
    }


class _Holder:
    """Holds slot variables out of sight of Keras's attribute tracking."""

    def __init__(self, items):
        self.items = items


class _WithSlots(keras.Model):
    def make_slots(self):
        """One `tf.Variable` per trainable variable, made before training."""
        self._slots = _Holder(
            [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                for v in self.trainable_variables
            ]
        )


class HandKeptModel(_WithSlots):
    """The best a user writes by hand: a `train_step` that keeps gradients.

    Keras's documented custom `train_step`, plus one `assign` per variable
    into a `tf.Variable` made beforehand (sparse gradients densified, as
    `tf.Variable.assign` needs).
    """

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        for slot, grad in zip(self._slots.items, grads):
            slot.assign(tf.convert_to_tensor(grad))
        self.optimizer.apply(grads, variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class FloorModel(_WithSlots):
    """Keras's own `train_step`, then one parameter-sized write.

    Each trainable variable's new value is copied into a `tf.Variable`: the
    floor of keeping anything, with no gradient involved. (Without XLA the
    assign shares the weight's buffer, and the next update of the weight
    copies it before changing it in place; after a sparse update, the read
    copies.)
    """

    def train_step(self, data):
        logs = super().train_step(data)
        for slot, variable in zip(self._slots.items, self.trainable_variables):
            slot.assign(variable.value, read_value=False)
        return logs


class RecomputeGradients(keras.callbacks.Callback):
    """Recomputes the batch's gradients after each step, in a `tf.function`.

    A separate forward and backward pass, as gradient-logging callbacks
    (`WandbCallback(log_gradients=True)` and the like) do.
    """

    def __init__(self, batch, loss_fn, jit_compile):
        super().__init__()
        self.batch = batch
        self.loss_fn = loss_fn
        self.jit_compile = jit_compile
        self.gradients = None
        self._fn = None

    def _grads(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        return tape.gradient(loss, self.model.trainable_variables)

    def on_train_batch_end(self, batch, logs=None):
        if self._fn is None:
            self._fn = tf.function(self._grads, jit_compile=self.jit_compile)
        self.gradients = self._fn(*self.batch)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# `--optimizer`: Keras's Adam updates a whole embedding table every step
# (the step is optimizer-bound); SGD updates only the batch's rows.
OPTIMIZERS = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}


def new_variant(variant, build, batch, jit_compile, weights=None, optimizer="adam"):
    """A compiled, untrained variant: `(model, callback or None)`.

    `weights` (from `get_weights()`) gives every variant the same start.
    """
    inputs, outputs = build()
    if variant in ("plain", "control", "recompute"):
        model = keras.Model(inputs, outputs)
    elif variant == "kept":
        model = kg.KeepGradModel(inputs, outputs)
    elif variant == "every10":
        model = kg.KeepGradModel(inputs, outputs, keep_every=10)
    elif variant == "off":
        model = kg.KeepGradModel(inputs, outputs, keep_gradients=False)
    elif variant in ("hand", "floor"):
        model = {"hand": HandKeptModel, "floor": FloorModel}[variant](inputs, outputs)
        model.make_slots()
    else:
        raise ValueError(f"Unknown variant: {variant!r}")
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=OPTIMIZERS[optimizer](1e-4), loss=_loss(), jit_compile=jit_compile)
    callback = None
    if variant == "recompute":
        callback = RecomputeGradients(batch, _loss(), jit_compile)
    return model, callback


def fit_briefly(model, callback, batch):
    """Two `fit` steps (which trace), then `(model, iterator, callback)`."""
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    model.fit(
        dataset,
        steps_per_epoch=2,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[callback] if callback else None,
    )
    # The iterator type `fit` uses, so `train_function` is not retraced.
    iterator = iter(model.distribute_strategy.experimental_distribute_dataset(dataset))
    return model, iterator, callback


def make_variant(variant, build, batch, jit_compile, weights=None, optimizer="adam"):
    """A compiled variant, fitted for 2 steps: `(model, iterator, callback)`.

    Call `warm_up` on all variants only after building the last one:
    building may seed, and `tf.random.set_seed` clears TensorFlow's kernel
    caches, which would put a first-call cost into the timed rounds.
    """
    model, callback = new_variant(variant, build, batch, jit_compile, weights, optimizer)
    return fit_briefly(model, callback, batch)


def warm_up(model, iterator, callback):
    """Traces `train_function` for this iterator type, outside the timing."""
    run_steps(model, iterator, callback, 3)


def run_steps(model, iterator, callback, steps):
    """`(wall, cpu)` seconds of `steps` training steps (callback as in `fit`).

    The CPU time is that of the whole process (all TensorFlow threads): less
    disturbed than the wall time by other processes on a shared machine.
    """
    train_function = model.train_function
    start, start_cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        logs = train_function(iterator)
        if callback is not None:
            callback.on_train_batch_end(step, logs)
    float(logs["loss"])  # the step's outputs exist: it has finished
    return time.perf_counter() - start, time.process_time() - start_cpu


def op_counts(name, spec, optimizer):
    """Ops in the traced `train_step` graph: plain, keep off, keep on."""
    build, batch_size, make_x = spec
    rng = np.random.default_rng(0)
    x = make_x(rng, batch_size)
    y = rng.integers(0, 10, (batch_size,)).astype("int32")
    batch = (tf.constant(x), tf.constant(y))
    data_spec = (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype))
    counts = {}
    keras.utils.set_random_seed(0)
    for variant in ("plain", "off", "kept"):
        model = make_variant(variant, build, batch, False, optimizer=optimizer)[0]
        graph = tf.function(model.train_step).get_concrete_function(data_spec).graph
        counts[variant] = collections.Counter(op.type for op in graph.get_operations())
    keras.backend.clear_session()
    extra = counts["kept"] - counts["plain"]
    return {
        "model": name,
        "plain": sum(counts["plain"].values()),
        "off": sum(counts["off"].values()),
        "kept": sum(counts["kept"].values()),
        "off_equals_plain": counts["off"] == counts["plain"],
        "kept_extra_ops": dict(sorted(extra.items())),
        "kept_missing_ops": dict(sorted((counts["plain"] - counts["kept"]).items())),
    }
