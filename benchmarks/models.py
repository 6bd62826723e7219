"""The benchmarks' models and variants.

`MODELS` (and `SMOKE_MODELS`, tiny ones of the same names) are Keras-only,
so every backend builds the same models. A variant is the model class a
timing compiles, its gradient metrics, or the callbacks its `fit` gets;
`base` and `control` are always two identical plain models (or, for the
metrics, two `KeepGradModel`s without gradient metrics).
"""

import collections
import functools

import keras
import numpy as np

import keras_keepgrad as kg

Spec = collections.namedtuple("Spec", "build batch_size shape vocab loss outputs")


def mlp(width_in, hidden, outputs=10, batch_size=128, loss="sparse"):
    def build():
        inputs = keras.Input((width_in,))
        h = inputs
        for i, units in enumerate(hidden):
            h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
        return inputs, keras.layers.Dense(outputs, name="logits")(h)

    return Spec(build, batch_size, (width_in,), None, loss, outputs)


def conv(size, filters, dense, batch_size=64):
    def build():
        inputs = keras.Input((size, size, 3))
        h = inputs
        for i, f in enumerate(filters):
            h = keras.layers.Conv2D(f, 3, activation="relu", name=f"conv_{i}")(h)
            h = keras.layers.MaxPooling2D(name=f"pool_{i}")(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(dense, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return Spec(build, batch_size, (size, size, 3), None, "sparse", 10)


def embedding(vocab, dim, length, batch_size=64):
    def build():
        inputs = keras.Input((length,), dtype="int32")
        h = keras.layers.Embedding(vocab, dim, name="embedding")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        h = keras.layers.Dense(64, activation="relu", name="dense")(h)
        return inputs, keras.layers.Dense(10, name="logits")(h)

    return Spec(build, batch_size, (length,), vocab, "sparse", 10)


MODELS = {
    # 512*1024 + 1024*512 + 512*10 (+ biases) = 1.06M parameters.
    "mlp_1m": mlp(512, [1024, 512]),
    # 1024*2048 + 2*2048*2048 + 2048*10 (+ biases) = 10.5M parameters.
    "mlp_10m": mlp(1024, [2048, 2048, 2048]),
    # CIFAR-sized: conv 32, conv 64, dense 128: 0.32M parameters.
    "conv": conv(32, [32, 64], 128),
    # 3.2M parameters, a sparse gradient of batch * length = 4096 rows.
    "embedding": embedding(50_000, 64, 64),
    # 32 -> 64 -> 64 -> 1, mse: 6.3k parameters, 0.9 ms steps.
    "mlp_6k": mlp(32, [64, 64], outputs=1, batch_size=64, loss="mse"),
    # 16 -> 32 -> 32 -> 10: 1.9k parameters.
    "tiny": mlp(16, [32, 32], batch_size=64),
    # 256 -> 880 -> 880 -> 10: 1.01M parameters.
    "mlp_1m_wide": mlp(256, [880, 880], batch_size=256),
}
SMOKE_MODELS = {
    # 16*32+32 + 32*10+10 = 874 parameters.
    "mlp_1m": mlp(16, [32], batch_size=8),
    "mlp_10m": mlp(16, [32, 32], batch_size=8),
    "conv": conv(8, [4], 8, batch_size=8),
    "embedding": embedding(100, 4, 5, batch_size=8),
    "mlp_6k": mlp(8, [4], outputs=1, batch_size=4, loss="mse"),
    "tiny": mlp(8, [4, 4], batch_size=4),
    "mlp_1m_wide": mlp(16, [32, 32], batch_size=8),
}


def batch_of(spec, batch_size=None, seed=0):
    """A numpy `(x, y)` batch for `spec`."""
    rng = np.random.default_rng(seed)
    n = batch_size or spec.batch_size
    if spec.vocab:
        x = rng.integers(0, spec.vocab, (n, *spec.shape)).astype("int32")
    else:
        x = rng.random((n, *spec.shape), "float32")
    if spec.loss == "mse":
        return x, rng.random((n, spec.outputs), "float32")
    return x, rng.integers(0, spec.outputs, (n,)).astype("int32")


def loss_of(spec):
    if spec.loss == "mse":
        return "mse"
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# `--optimizer`: Keras's Adam updates a whole embedding table every step
# (the step is optimizer-bound); SGD updates only the batch's rows.
OPTIMIZERS = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}


def compiled(spec, cls, weights=None, metrics=None, jit_compile="auto", optimizer="adam", **kw):
    """A compiled `cls(inputs, outputs, **kw)` of `spec`, from `weights`.

    `optimizer`: a name in `OPTIMIZERS` (learning rate 1e-4), or an instance.
    """
    model = cls(*spec.build(), **kw)
    if weights is not None:
        model.set_weights(weights)
    if isinstance(optimizer, str):
        optimizer = OPTIMIZERS[optimizer](1e-4)
    model.compile(
        optimizer=optimizer,
        loss=loss_of(spec),
        metrics=metrics,
        jit_compile=jit_compile,
    )
    return model


# What keeping costs: `keeping` times these against a plain `keras.Model`.
KEEPING = ("plain", "control", "kept", "every10", "hand", "floor", "recompute")
# `skip_bad_steps` on: judged against the first of `SKIPPING_FLOORS` that
# ran (`run.py keeping --variants kept kept_pass kept_wait skip skip_spike`).
SKIPPING = ("skip", "skip_spike")
# Keeping plus one pass over the gradients (a `GradientNorm()` metric: each
# gradient's sum of squares, the pass the skip's judgement makes): the least
# judging every gradient can add to keeping.
SKIPPING_FLOOR = "kept_pass"
# TensorFlow: keeping, that pass, and the optimizer's update made to wait
# for a judgement of its result (no branch: the update always runs). An
# exact skip cannot update before every gradient is judged; where the
# graph would otherwise overlap the update with the pass, this is the
# least such a skip costs.
WAITING_FLOOR = "kept_wait"
# TensorFlow without XLA: `kept_wait` with each write of the update in a
# `tf.cond` on the judgement, as the skip's (the branch always taken: the
# update is `kept`'s), the iteration count's too. An exact skip there must
# make each write conditional: a selection per write is another pass over
# each variable, a branch around the whole update makes all of it wait,
# and a `Switch` per write measured within noise of a `tf.cond`. Under a
# strategy of several replicas, as the skip's: the update in one `tf.cond`
# where the replicas meet (a `tf.cond` per write to each replica's copy
# measured 6.5 points of a step more), and each replica's copy of the
# iteration count in one of its own.
GUARDED_FLOOR = "kept_guard"
SKIPPING_FLOORS = (GUARDED_FLOOR, WAITING_FLOOR, SKIPPING_FLOOR, "kept")
# The spike check's own floors (TensorFlow): `kept_guard` and `kept_wait`
# whose judgement is also the spike rule written bare, as a user of
# TensorFlow would (the norm from the judgement's sum, the median of a
# window variable of the last norms, the comparison, and the window
# shifted and written once a step). `skip_spike` is judged against the
# one with the spike rule of `skip`'s floor where it ran, else as `skip`.
SPIKE_FLOORS = {GUARDED_FLOOR: "kept_guard_spike", WAITING_FLOOR: "kept_wait_spike"}
# The bare rule's factor and window: `skip_spike`'s.
SPIKE_FACTOR, SPIKE_WINDOW = 10.0, 100
# Keeping under Keras's own skipping of non-finite steps: a float32
# `LossScaleOptimizer(Adam)` (its finite check and its branch around the
# update, plus scaling the loss and unscaling the gradients).
KERAS_SKIPPING = "kept_lso"


def keeping_model(variant, spec, weights, jit_compile, optimizer):
    """`(model, callback or None)`: a compiled variant of `KEEPING` (or `off`)."""
    backend = keras.backend.backend()
    cls, kw, callback, metrics = keras.Model, {}, None, None
    if variant == "kept":
        cls = kg.KeepGradModel
    elif variant == "every10":
        cls, kw = kg.KeepGradModel, {"keep_every": 10}
    elif variant == "off":
        cls, kw = kg.KeepGradModel, {"keep_gradients": False}
    elif variant == "skip":
        cls, kw = kg.KeepGradModel, {"skip_bad_steps": True}
    elif variant == "skip_spike":
        spike = kg.SkipBadSteps(spike_factor=SPIKE_FACTOR, window=SPIKE_WINDOW)
        cls, kw = kg.KeepGradModel, {"skip_bad_steps": spike}
    elif variant == SKIPPING_FLOOR:
        cls, metrics = kg.KeepGradModel, [kg.metrics.GradientNorm()]
    elif variant in (WAITING_FLOOR, SPIKE_FLOORS[WAITING_FLOOR]):
        if backend != "tensorflow":
            raise ValueError(f"Variant {variant!r} is timed on TensorFlow only.")
        cls = kg.KeepGradModel
        spikes = variant != WAITING_FLOOR
        optimizer = _waiting(OPTIMIZERS[optimizer], jit_compile, spikes=spikes)(1e-4)
    elif variant in (GUARDED_FLOOR, SPIKE_FLOORS[GUARDED_FLOOR]):
        if backend != "tensorflow" or jit_compile is True:
            raise ValueError(f"Variant {variant!r} is timed on TensorFlow without XLA only.")
        cls = kg.KeepGradModel
        spikes = variant != GUARDED_FLOOR
        optimizer = _waiting(OPTIMIZERS[optimizer], False, guarded=True, spikes=spikes)(1e-4)
    elif variant == KERAS_SKIPPING:
        cls = kg.KeepGradModel
        optimizer = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[optimizer](1e-4))
    elif variant in ("hand", "floor", "recompute") and backend != "tensorflow":
        if (variant, backend) != ("floor", "torch"):
            raise ValueError(f"Variant {variant!r} is timed on TensorFlow only.")
        cls = _torch_floor_model()
    elif variant in ("hand", "floor"):
        cls = _tf_models()[variant]
    elif variant not in ("plain", "control", "recompute"):
        expected = KEEPING + SKIPPING + (SKIPPING_FLOOR, WAITING_FLOOR, GUARDED_FLOOR)
        expected += (*SPIKE_FLOORS.values(), KERAS_SKIPPING)
        raise ValueError(f"Unknown variant: {variant!r}. Expected one of {expected}.")
    model = compiled(
        spec, cls, weights, metrics, jit_compile=jit_compile, optimizer=optimizer, **kw
    )
    if variant in ("hand", "floor") and backend == "tensorflow":
        model.make_slots()
    if variant == "recompute":
        callback = _recompute_callback(spec, jit_compile)
    return model, callback


def _tf_models():
    import tensorflow as tf

    class Holder:
        """Holds slot variables out of sight of Keras's attribute tracking."""

        def __init__(self, items):
            self.items = items

    class WithSlots(keras.Model):
        def make_slots(self):
            """One `tf.Variable` per trainable variable, made before training."""
            self._slots = Holder(
                [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                    for v in self.trainable_variables
                ]
            )

    class HandKeptModel(WithSlots):
        """What a user writes without this library: Keras's documented
        custom `train_step` plus one `assign` per variable into a
        `tf.Variable` made beforehand (sparse gradients densified)."""

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

    class FloorModel(WithSlots):
        """Keras's own `train_step`, then one parameter-sized write: the
        floor of keeping anything. (Without XLA the assign shares the
        weight's buffer, and the next update of the weight copies it.)"""

        def train_step(self, data):
            logs = super().train_step(data)
            for slot, variable in zip(self._slots.items, self.trainable_variables):
                slot.assign(variable.value, read_value=False)
            return logs

    return {"hand": HandKeptModel, "floor": FloorModel}


def _waiting(optimizer_class, jit_compile, guarded=False, spikes=False):
    """`optimizer_class`, whose update waits for the gradients' global sum
    of squares to be judged finite, and then runs whatever it found.

    What waits is what waits in an exact skip: under XLA and under a
    strategy of several replicas, the whole update (the skip selects, or
    branches where the replicas meet); else each of the update's writes.
    With `guarded` (no XLA) each of those writes also runs in a `tf.cond`
    of its own on the judgement, as the skip's do, the iteration count's
    too; under a strategy of several replicas the whole update runs in one
    `tf.cond` where the replicas meet, and each replica's copy of the
    iteration count in one of its own, as the skip's. With
    `spikes` the judgement is also the spike rule of `skip_spike`, bare:
    the global norm (from the same sum) not above `SPIKE_FACTOR` times the
    median of the last `SPIKE_WINDOW` finite norms once that many were
    recorded, which the optimizer keeps in a variable of its own (`-1`
    where none was recorded yet), shifted and written once a step.
    """
    import tensorflow as tf

    def values(g):
        return g.values if isinstance(g, tf.IndexedSlices) else g

    def times(g, factor):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
        return g * factor

    def several_replicas():
        context = tf.distribute.get_replica_context()
        return context is not None and context.num_replicas_in_sync > 1

    def after(finite, g):
        # `g`, through an op that reads `finite`, so that the update waits
        # for the judgement. A control dependency would not do: Grappler's
        # dependency optimizer drops one on ops without side effects, and
        # with it the judgement (timed so, the floor was `kept`). A reshape
        # to its own shape copies nothing.
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(after(finite, g.values), g.indices, g.dense_shape)
        shape = tf.shape(g)
        return tf.reshape(g, tf.where(finite, shape, shape))

    def written_if(run, write):
        # `write()` in a branch taken where `run` holds; whether it was.
        def written():
            write()
            return tf.constant(True)

        return tf.cond(run, written, lambda: tf.constant(False))

    class Waiting(optimizer_class):
        # On one device without XLA: while the update is traced, the write
        # of the step's judgement into `_flag` (a stateful op, whose control
        # edges Grappler keeps), which each write of the update waits for.
        _judgement = None
        _flag = None

        _run = None  # with `guarded`: the judgement each write is in a branch on
        # With `guarded` under a strategy of several replicas: each
        # replica's judgement, by the graph traced and the replica.
        _runs = None
        norms = None  # with `spikes`: the last norms, oldest first

        def build(self, variables):
            if self.built:
                return
            super().build(variables)
            strategy = self._distribution_strategy
            if guarded:
                if strategy.num_replicas_in_sync > 1:
                    self._runs = {}
                # An exact skip leaves the iteration count as it was too,
                # which Keras writes outside the optimizer's `assign`s: each
                # copy (a replica's, written where the replicas meet) in a
                # branch on its judgement.
                count = self._iterations.value
                for replica, copy in enumerate(strategy.experimental_local_results(count)):
                    self._guard_copy(copy, replica)
            if spikes:
                # As the skip's window: each replica's own, written in place.
                with strategy.scope():
                    self.norms = keras.Variable(
                        keras.initializers.Constant(-1.0),
                        shape=(SPIKE_WINDOW,),
                        trainable=False,
                        synchronization="on_read",
                        aggregation="only_first_replica",
                        name="norms",
                    )

        def judge(self, grads):
            if jit_compile and not spikes:
                # Under XLA the non-finite skip looks at every entry (fused
                # into one pass, no branch): its floor's judgement is that.
                finite = [tf.reduce_all(tf.math.is_finite(values(g))) for g in grads]
                return tf.reduce_all(tf.stack(finite))
            # One pass per gradient, as the skip's judgement makes (`l2_loss`).
            squares = [tf.nn.l2_loss(tf.cast(values(g), "float32")) for g in grads]
            total = tf.add_n(squares)
            good = tf.math.is_finite(total)
            if not spikes:
                return good
            # An `l2_loss` is half a sum of squares. (A sparse gradient's
            # rows are summed as they are, repeated indices too: a floor
            # that does less than the skip, which densifies them first.)
            norm = tf.sqrt(2.0 * total)
            norms = self.norms.value
            ordered = tf.sort(norms)
            half = SPIKE_WINDOW // 2
            median = (ordered[(SPIKE_WINDOW - 1) // 2] + ordered[half]) / 2.0
            spiked = tf.logical_and(ordered[0] > -1.0, norm > SPIKE_FACTOR * median)
            shifted = tf.concat([norms[1:], tf.reshape(norm, (1,))], 0)
            joins = tf.logical_and(good, tf.math.is_finite(norm))
            self.norms.assign(tf.where(joins, shifted, norms))
            return tf.logical_and(good, tf.logical_not(spiked))

        def judged(self, grads):
            judgement = self.judge(grads)
            return [after(judgement, g) for g in grads]

        def _guarded(self, write):
            if self._run is None:
                return write()
            written_if(self._run, write)

        def assign(self, variable, value):
            with self._waiting():
                return self._guarded(lambda: super(Waiting, self).assign(variable, value))

        def assign_add(self, variable, value):
            with self._waiting():
                return self._guarded(lambda: super(Waiting, self).assign_add(variable, value))

        def assign_sub(self, variable, value):
            with self._waiting():
                return self._guarded(lambda: super(Waiting, self).assign_sub(variable, value))

        def _waiting(self):
            return tf.control_dependencies([] if self._judgement is None else [self._judgement])

        def _run_of(self, replica):
            if self._runs is None:
                return self._run  # one device
            return self._runs.get((tf.compat.v1.get_default_graph(), replica))

        def _guard_copy(self, copy, replica):
            def guarded(method):
                def write(value, use_locking=False, name=None, read_value=True):
                    run = self._run_of(replica)
                    if run is None:  # not in a step
                        return method(value, use_locking, name, read_value)
                    done = written_if(run, lambda: method(value, read_value=False))
                    if not read_value:
                        return done.op
                    with tf.control_dependencies([done]):
                        return copy.read_value()

                return write

            # Keras writes the count as `assign(count + 1)`.
            for name in ("assign", "assign_add", "assign_sub"):
                setattr(copy, name, guarded(getattr(copy, name)))

        def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
            update = super()._distributed_tf_update_step
            # On one device each write is guarded instead.
            run = None if self._runs is None else self._run_of(0)
            if run is None:
                return update(distribution, grads_and_vars, learning_rate)
            # Where the replicas meet, all judged the same global gradients.
            written_if(run, lambda: update(distribution, grads_and_vars, learning_rate))

        def apply(self, grads, trainable_variables=None):
            try:
                return super().apply(grads, trainable_variables)
            finally:
                self._run = None  # set by `_backend_apply_gradients`

        def _all_reduce_sum_gradients(self, grads_and_vars):
            reduced = super()._all_reduce_sum_gradients(grads_and_vars)
            if not several_replicas():
                return reduced
            # Under a strategy an exact skip judges the global sums, the
            # all-reduce's: the update waits for a judgement of those (with
            # `guarded`, it is in a branch on it).
            grads = [g for g, _ in reduced if g is not None]
            if guarded:
                context = tf.distribute.get_replica_context()
                replica = int(tf.get_static_value(context.replica_id_in_sync_group))
                self._runs[tf.compat.v1.get_default_graph(), replica] = self.judge(grads)
                return reduced
            present = iter(self.judged(grads))
            return [(None if g is None else next(present), v) for g, v in reduced]

        def _backend_apply_gradients(self, grads, trainable_variables):
            if several_replicas():
                return super()._backend_apply_gradients(grads, trainable_variables)
            judgement = self.judge(grads)
            if jit_compile:
                # XLA orders by data, not by control edges, and drops a
                # judgement only control edges use (so timed, the floor came
                # to `kept`'s time); fused into the update, the product is no
                # further pass.
                grads = [times(g, tf.cast(judgement, g.dtype)) for g in grads]
                return super()._backend_apply_gradients(grads, trainable_variables)
            # Only the writes wait, as the skip's guarded writes do: the
            # update's arithmetic overlaps the judgement's pass.
            if guarded:
                # The branch makes each write wait: no flag needed. Set
                # until `apply` returns, which writes the iteration count.
                self._run = judgement
                return super()._backend_apply_gradients(grads, trainable_variables)
            if self._flag is None:
                with tf.init_scope():
                    self._flag = tf.Variable(False, trainable=False)
            self._judgement = self._flag.assign(judgement, read_value=False)
            try:
                return super()._backend_apply_gradients(grads, trainable_variables)
            finally:
                self._judgement = None

    return Waiting


def _torch_floor_model():
    import torch

    class CopyingModel(keras.Model):
        """A plain model that copies every gradient after its step."""

        def train_step(self, data):
            logs = super().train_step(data)
            with torch.no_grad():
                self.copies = [v.value.grad.clone() for v in self.trainable_weights]
            return logs

    return CopyingModel


def _recompute_callback(spec, jit_compile):
    import tensorflow as tf

    x, y = (tf.constant(a) for a in batch_of(spec))
    loss_fn = loss_of(spec)
    loss_fn = keras.losses.get(loss_fn) if isinstance(loss_fn, str) else loss_fn

    class RecomputeGradients(keras.callbacks.Callback):
        """Recomputes the batch's gradients after each step with a separate
        forward and backward pass in a `tf.function`, as gradient-logging
        callbacks (`WandbCallback(log_gradients=True)` and the like) do."""

        def _grads(self):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, self.model(x, training=True))
            return tape.gradient(loss, self.model.trainable_variables)

        def on_train_batch_end(self, batch, logs=None):
            if not hasattr(self, "_fn"):
                self._fn = tf.function(self._grads, jit_compile=jit_compile)
            self.gradients = self._fn()

    return RecomputeGradients()


# What gradient metrics cost on top of keeping: `metrics` and `dynamics`
# time `KeepGradModel`s compiled with these against one without.
METRICS = ("reference", "control", "grad_norm", "per_layer", "all")
DYNAMICS = ("reference", "control", "grad_norm", "noise_scale", "snr", "cosine")
DYNAMICS += ("cosine_per_layer", "floor_window", "floor_dot")
# Each statistic's floor: the least parameter-sized work it must do, with
# replicas in the process (no window) and without.
FLOORS = {
    "noise_scale": "floor_window",
    "snr": "floor_window",
    "cosine": "floor_dot",
    "cosine_per_layer": "floor_dot",
}
MIRRORED_FLOORS = dict(FLOORS, noise_scale="floor_replicas", snr="floor_replicas")


def gradient_metrics(variant):
    """Fresh metric objects of a `METRICS` or `DYNAMICS` variant."""
    m = kg.metrics
    if variant.startswith("floor_"):
        return [_floor_metric(variant)]
    return {
        "reference": [],
        "control": [],
        "grad_norm": [m.GradientNorm()],
        "per_layer": [m.GradientNorm(per_layer=True)],
        "all": [
            m.GradientNorm(),
            m.GradientNorm(per_layer=True, name="layer_norm"),
            m.GradientMaxAbs(),
            m.NonFiniteGradients(),
            m.VanishingGradients(),
            m.UpdateRatio(),
        ],
        "noise_scale": [m.GradientNoiseScale()],
        "snr": [m.GradientSNR()],
        "cosine": [m.GradientCosine()],
        "cosine_per_layer": [m.GradientCosine(per_layer=True)],
    }[variant]


def _floor_metric(kind):
    """The bare parameter-sized work of a statistic, as a gradient metric.

    All three take the step's sums of squares (shared with `GradientNorm`).
    `floor_window`: an add of every gradient into a float32 buffer (read
    the gradient and the buffer, write the buffer): the noise scale and
    the SNR on one device. `floor_dot`: a dot product of every gradient
    with its copy from the previous step, and the copy: the cosine.
    `floor_replicas` (TensorFlow): the squared norms of each replica's
    partial gradient, summed in one all-reduce of a scalar: the noise scale
    and the SNR with replicas in the process.

    The buffers are held as the dynamics metrics hold theirs: on TensorFlow
    plain `tf.Variable`s made outside the traced step; on JAX and PyTorch
    the metric's own Keras variables, made before the step is traced (JAX
    threads them through its stateless step as metrics variables).
    """
    if keras.backend.backend() == "tensorflow":
        return _tf_floor(kind)
    if kind == "floor_replicas":
        raise ValueError("`floor_replicas` is timed on TensorFlow only (`--mirrored`).")
    return _keras_floor(kind)


def _private():
    """The library's private helpers the floors use, in one place.

    `shared_squares`: the step's per-variable sums of squares, which the
    statistics and the norm metrics share (a floor that computed its own
    would count a pass they do not make). On TensorFlow also
    `create_outside_step` and `local_variable`: how the dynamics metrics
    make their buffers.
    """
    from keras_keepgrad import _squares

    found = dict(shared_squares=_squares.shared_squares)
    if keras.backend.backend() == "tensorflow":
        from keras_keepgrad import _capture
        from keras_keepgrad.metrics import dynamics

        found.update(
            create=dynamics.create_outside_step,
            local_variable=dynamics.local_variable,
            current_step=_capture.current_step,
        )
    return found


def _tf_floor(kind):
    import tensorflow as tf

    private = _private()

    class Floor(kg.metrics.GradientMetric):
        def __init__(self):
            super().__init__(fn=None, name=kind)
            self._buffers = None

        def _step_values(self, grads):
            dense = {p: tf.cast(g, tf.float32) for p, g in grads.items()}
            if self._buffers is None:
                self._buffers = private["create"](
                    lambda: {
                        p: private["local_variable"](tf.zeros(g.shape)) for p, g in dense.items()
                    }
                )
            value = tf.cast(tf.reduce_sum(private["shared_squares"](grads)), tf.float32)
            if kind == "floor_replicas":
                partial = private["current_step"]().grads
                local = tf.add_n([tf.nn.l2_loss(tf.cast(g, tf.float32)) for g in partial.values()])
                context = tf.distribute.get_replica_context()
                return {self.name: value + context.all_reduce(tf.distribute.ReduceOp.SUM, local)}
            if kind == "floor_window":
                for p, g in dense.items():
                    self._buffers[p].assign_add(g, read_value=False)
            else:
                # `reduce_sum(g * h)`: the fastest dot product of two
                # parameter-sized tensors found without XLA.
                held = {p: tf.convert_to_tensor(b) for p, b in self._buffers.items()}
                value += tf.add_n([tf.reduce_sum(g * held[p]) for p, g in dense.items()])
                # The assignment shares the gradient's buffer (without XLA).
                for p, g in dense.items():
                    self._buffers[p].assign(g, read_value=False)
            return {self.name: value}

    return Floor()


def _keras_floor(kind):
    """On JAX and PyTorch. JAX: `ops.sum(g * h)` and an assignment of
    `h + g`, which XLA fuses and, the state being donated, writes in place.
    PyTorch, which runs each op as it comes: the least each needs there, an
    in-place `add_` of the gradient into the buffer (one pass) and
    `torch.dot` (one fused kernel, no product tensor), and the copy a
    variable's assignment makes."""
    from keras import ops

    private = _private()
    torch_backend = keras.backend.backend() == "torch"

    def dot(g, h):
        if torch_backend:
            import torch

            return torch.dot(g.reshape(-1), h.reshape(-1))
        return ops.sum(g * h)

    class Floor(kg.metrics.GradientMetric):
        def __init__(self):
            super().__init__(fn=None, name=kind)
            self._buffers = {}

        def _build_for(self, variables):
            # Before JAX traces the step, which must find them among the
            # metrics variables it is given.
            super()._build_for(variables)
            for v in variables:
                if v.path not in self._buffers:
                    self._buffers[v.path] = self.add_variable(
                        shape=tuple(v.shape),
                        initializer="zeros",
                        aggregation="only_first_replica",
                        name="floor",
                    )

        def _step_values(self, grads):
            dense = {p: ops.cast(g, "float32") for p, g in grads.items()}
            value = ops.sum(private["shared_squares"](grads))
            buffers = self._buffers
            if kind == "floor_window":
                if torch_backend:
                    import torch

                    with torch.no_grad():
                        for p, g in dense.items():
                            buffers[p].value.add_(g)
                else:
                    for p, g in dense.items():
                        buffers[p].assign(ops.convert_to_tensor(buffers[p]) + g)
            else:
                held = {p: ops.convert_to_tensor(buffers[p]) for p in dense}
                value = value + functools.reduce(
                    ops.add, [dot(g, held[p]) for p, g in dense.items()]
                )
                for p, g in dense.items():
                    buffers[p].assign(g)
            return {self.name: value}

    return Floor()


# What watching costs, per `fit`: `tensorboard` runs each setup's variants,
# each `fit` with fresh callbacks and a fresh log directory.
SETUPS = {
    # Every backend: watching every batch against plain Keras's own
    # TensorBoard writing every batch.
    "watched": dict(
        models=("tiny", "mlp_1m_wide"),
        variants=("plain", "control", "watched"),
        rounds=10,
        steps=200,
        epochs=1,
    ),
    # TensorFlow: everything at once, histograms too.
    "batch": dict(
        models=("mlp_6k", "mlp_1m"),
        variants=("plain", "control", "kept", "all"),
        rounds=5,
        steps=1000,
        epochs=2,
    ),
    # TensorFlow: GradientTensorBoard against Keras's TensorBoard, one
    # KeepGradModel class for every variant.
    "epoch": dict(
        models=("mlp_1m",),
        variants=(
            "none",
            "control",
            "keras_tb",
            "grad_tb",
            "keras_tb_1",
            "grad_tb_1",
            "monitor",
        ),
        rounds=15,
        steps=100,
        epochs=2,
    ),
}


def watch_variant(setup, variant, log_dir):
    """`(model class, gradient metrics, callbacks)` of a `SETUPS` variant."""
    cb, m = kg.callbacks, kg.metrics
    if setup == "epoch":
        return (
            kg.KeepGradModel,
            None,
            {
                "none": [],
                "control": [],
                "keras_tb": [keras.callbacks.TensorBoard(log_dir, update_freq="epoch")],
                "grad_tb": [cb.GradientTensorBoard(log_dir, update_freq="epoch")],
                "keras_tb_1": [keras.callbacks.TensorBoard(log_dir, update_freq=1)],
                "grad_tb_1": [cb.GradientTensorBoard(log_dir, update_freq=1)],
                "monitor": [cb.GradientMonitor()],
            }[variant],
        )
    freq = dict(update_freq=1, histogram_freq=1 if setup == "batch" else 0)
    if variant in ("plain", "control", "kept"):
        cls = kg.KeepGradModel if variant == "kept" else keras.Model
        return cls, None, [keras.callbacks.TensorBoard(log_dir, **freq)]
    metrics = [m.GradientNorm()]
    if variant == "all":
        metrics.append(m.GradientNorm(per_layer=True))
    elif variant != "watched":
        raise ValueError(f"Unknown variant of {setup!r}: {variant!r}")
    callbacks = [cb.GradientTensorBoard(log_dir, **freq), cb.GradientMonitor()]
    return kg.KeepGradModel, metrics, callbacks
