"""`skip_bad_steps`: the shared cases (`skipping_cases`) in every mode of
every backend, the arguments, saving, TensorBoard, and TensorFlow's
strategies."""

import os
import re

import keras
import numpy as np
import pytest
import skipping_cases as cases
import tensorflow as tf
from conftest import BACKEND
from conftest import MODES
from conftest import REPO
from conftest import X
from conftest import Y
from conftest import jax_mse_and_gradients
from conftest import mse_gradients
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad import _spikes
from keras_keepgrad.callbacks import _skipped

CASES = [
    cases.nan_step_leaves_the_state_bit_identical,
    cases.spike_above_the_factor_is_skipped_below_it_is_not,
    cases.finite_gradient_whose_square_overflows_is_not_skipped,
    cases.applied_update_that_overflows_a_weight_stays_applied,
    cases.history_counts_the_skipped_steps_per_epoch,
    cases.own_train_step_is_guarded,
    cases.off_changes_nothing,
    cases.under_loss_scaling,
    cases.flagged_counts_per_epoch_like_skipped,
    cases.monitor_reports_a_skipped_nan_step_as_skipped,
    cases.monitor_reports_a_skipped_spike_as_skipped_not_exploding,
    cases.monitor_reports_a_nan_the_skip_let_through_as_nonfinite,
    cases.monitor_knows_a_kept_step_skipped_before_its_check,
]

SAVING_CASES = [
    cases.nan_batch_is_saved_with_its_gradients,
    cases.spike_batch_is_saved_and_replays_to_its_gradients,
    cases.saved_files_stop_at_max_saved,
    cases.an_earlier_runs_file_of_the_same_name_is_kept,
    cases.saving_adds_one_counter_and_off_adds_none,
    cases.saved_loss_scale_is_the_steps,
    cases.dict_inputs_are_saved_per_key_and_replayed,
    cases.flagged_steps_are_applied_counted_and_saved,
    cases.flagged_under_loss_scaling_is_skipped_by_the_optimizer,
]


# Under `torch.compile` on PyTorch the skip's judgement, its guarded update,
# its counts and the saving all run eagerly, outside the compiled graphs
# (`_torch_compile`), as in an eager step; what compiling changes is where
# the step's graphs break around them. These cases cross each of those
# breaks (the judgement of either kind, an own step, loss scaling, a saved
# batch with its replay); the other cases run there uncompiled
# (`not_compiled_on_torch`), and compiled on TensorFlow and JAX.
COMPILED_ON_TORCH = {
    cases.nan_step_leaves_the_state_bit_identical,
    cases.spike_above_the_factor_is_skipped_below_it_is_not,
    cases.own_train_step_is_guarded,
    cases.under_loss_scaling,
    cases.spike_batch_is_saved_and_replays_to_its_gradients,
}
_NOT_COMPILED_ON_TORCH = pytest.mark.not_compiled_on_torch(
    reason="their breaks are crossed by the cases in COMPILED_ON_TORCH"
)


def _in_modes(shared_cases):
    return [
        pytest.param(
            case,
            MODES[name],
            id=f"{name}-{case.__name__}",
            marks=() if case in COMPILED_ON_TORCH else _NOT_COMPILED_ON_TORCH,
        )
        for name in MODES
        for case in shared_cases
    ]


@pytest.mark.parametrize("case, mode", _in_modes(CASES))
def test_skipping(case, mode):
    case(mode)


@pytest.mark.parametrize("case, mode", _in_modes(SAVING_CASES))
def test_saving_bad_batches(case, mode, tmp_path):
    case(mode, tmp_path)


def test_arguments_are_checked_with_their_names():
    with pytest.raises(TypeError, match=r"skip_bad_steps=.yes. of type str"):
        one_weight(skip_bad_steps="yes")
    with pytest.raises(ValueError, match=r"`spike_factor` must be a finite number above 1"):
        kg.SkipBadSteps(spike_factor=1.0)
    with pytest.raises(ValueError, match=r"`window` must be a positive int. Received: window=0"):
        kg.SkipBadSteps(window=0)
    with pytest.raises(TypeError, match=r"`nonfinite` must be a bool"):
        kg.SkipBadSteps(nonfinite=1)
    with pytest.raises(ValueError, match=r"checks nothing"):
        kg.SkipBadSteps(nonfinite=False)
    with pytest.raises(TypeError, match=r"`skip` must be a bool .* Received: skip='no'"):
        kg.SkipBadSteps(skip="no")
    with pytest.raises(
        ValueError, match=r"`updates_per_step` must be a positive int. Received: updates_per_step=0"
    ):
        kg.SkipBadSteps(spike_factor=2.0, updates_per_step=0)
    model = one_weight(skip_bad_steps=True)
    with pytest.raises(TypeError, match=r"Received: skip_bad_steps=3"):
        model.skip_bad_steps = 3
    assert model.skip_bad_steps == kg.SkipBadSteps()


def test_skipping_needs_kept_gradients():
    model = one_weight(keep_gradients=False, skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"keeps no gradients \(`keep_gradients=False`\)"):
        model.fit(X, Y, verbose=0)
    # Refused before anything ran: w is 3 still.
    assert float(keras.ops.convert_to_numpy(model.weights[0])[0, 0]) == 3.0


class OwnSGD(keras.optimizers.SGD):
    """An optimizer of the user's own: it may write variables of its own."""


@pytest.mark.backends("tensorflow", reason="tf.cond, or guarded tf.Variable writes")
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("sgd, guarded", [(keras.optimizers.SGD, True), (OwnSGD, False)])
def test_guarded_writes_and_a_branched_update_skip_alike(sgd, guarded, jit_compile, monkeypatch):
    # Keras's own optimizer: each write is guarded (selected under XLA, in
    # a branch of its own without), as each training function is traced;
    # the user's own: a `tf.cond` around its whole update.
    from keras_keepgrad.backend.tensorflow import skipping

    seen = []
    guarding = skipping._guarding_writes
    monkeypatch.setattr(skipping, "_guarding_writes", lambda *a: seen.append(a[2]) or guarding(*a))
    cases.nan_step_leaves_the_state_bit_identical(dict(jit_compile=jit_compile), sgd=sgd)
    assert seen == ([jit_compile] * len(seen) if guarded else [])
    assert bool(seen) is guarded


@pytest.mark.not_compiled_on_torch(
    reason="PyTorch judges from the sums, compiled or not: its eager case"
)
@pytest.mark.parametrize("spikes", [False, True], ids=["nonfinite", "spikes"])
@pytest.mark.parametrize("name", list(MODES))
def test_tf_xla_judges_the_entries_without_a_spike_rule_else_the_sums(name, spikes, monkeypatch):
    # Under TensorFlow's XLA a branch on the sums is a conditional that
    # the update's fusions wait on whole; elsewhere, or where the spike
    # rule reads the sums anyway, they judge, and the entries only in a
    # branch (JAX's jitted step too, where that measured cheaper).
    from keras_keepgrad import _squares

    asked = []
    shared_finite = _squares.shared_finite
    monkeypatch.setattr(_squares, "shared_finite", lambda g: asked.append(1) or shared_finite(g))
    skipping = kg.SkipBadSteps(spike_factor=3.0, window=3) if spikes else True
    model = one_weight(skip_bad_steps=skipping)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **MODES[name])
    logs = [cases.one_step(model, x)["skipped_steps"] for x in (X, cases.NAN_X, X)]
    assert logs == [0.0, 1.0, 0.0]
    entries = name == "jit" and BACKEND == "tensorflow" and not spikes
    assert (asked == []) is entries


KERAS_OPTIMIZERS = {
    "adam_accumulating": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
    "adam_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=3),
    "adamw": lambda: keras.optimizers.AdamW(1e-2),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "adadelta": lambda: keras.optimizers.Adadelta(1e-2),
    "adagrad": lambda: keras.optimizers.Adagrad(1e-2),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "ftrl": lambda: keras.optimizers.Ftrl(1e-2),
    "lamb": lambda: keras.optimizers.Lamb(1e-2),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-2),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2, momentum=0.5, centered=True),
    "sgd_clipped": lambda: keras.optimizers.SGD(1e-2, momentum=0.9, global_clipnorm=0.5),
}
# Newer than the oldest Keras tested (3.10): where this Keras has them.
# Keras 3.10's Muon keys its moments by `variable.path`, and its TensorFlow
# update hands it a `tf.Variable`, which has none: plain Keras fails there.
_MUON_FAILS = keras.backend.backend() == "tensorflow" and keras.version().startswith("3.10.")
if hasattr(keras.optimizers, "Muon") and not _MUON_FAILS:
    KERAS_OPTIMIZERS["muon"] = lambda: keras.optimizers.Muon(1e-2)
if hasattr(keras.optimizers, "ScheduleFreeAdamW"):
    KERAS_OPTIMIZERS["schedule_free"] = lambda: keras.optimizers.ScheduleFreeAdamW(1e-2)
if hasattr(keras.optimizers, "MultiOptimizer"):
    KERAS_OPTIMIZERS["multi"] = lambda: _multi()


def _multi():
    # Kernels and biases each with an optimizer of their own (and state of
    # their own); the `MultiOptimizer`'s one `apply` is judged once.
    kernels, biases = keras.optimizers.Adam(1e-2), keras.optimizers.SGD(1e-2, momentum=0.9)
    return keras.optimizers.MultiOptimizer(lambda v: kernels if "kernel" in v.path else biases)


def _with_bad_batches():
    """56 rows of 4 features, their targets, and the `skip_bad_steps` that
    skips the sixth and seventh batches of 8 rows: row 45 is 10^4 times the
    others (window 5, factor 10: that batch's gradient norm is far above
    10 times the median of the first five's), row 53 holds a NaN."""
    rows = np.random.RandomState(1).rand(56, 4).astype("float32")
    targets = np.random.RandomState(2).rand(56, 1).astype("float32")
    rows[45] *= 1e4
    rows[53, 2] = np.nan
    return rows, targets, kg.SkipBadSteps(spike_factor=10.0, window=5)


def _fitted(cls, options, make, rows, targets, jit_compile):
    """A 4-8-1 MLP of `cls`, compiled with `make()`, fitted in one `fit` on
    `rows` (batches of 8): its every weight and optimizer variable, as
    bytes, and its `History` (`.model` is the model)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(1)(hidden), **options)
    model.compile(optimizer=make(), loss="mse", jit_compile=jit_compile)
    history = model.fit(rows, targets, batch_size=8, shuffle=False, verbose=0)
    return cases.state_bytes(model), history


@pytest.mark.parametrize("make", KERAS_OPTIMIZERS.values(), ids=KERAS_OPTIMIZERS)
def test_keras_optimizers_apply_as_plain_keras_and_skip_exactly(make):
    """Five batches, then a spike and a NaN, in one `fit` (JAX's EMA refuses
    a second `fit` in plain Keras too): the skipping model ends
    bit-identical to a plain `keras.Model` fitted on the five. JAX jitted,
    TensorFlow and PyTorch without XLA (XLA compiles each program its own
    way, see docs/skipping.md)."""
    rows, targets, skipping = _with_bad_batches()
    jit = keras.backend.backend() == "jax"
    plain, _ = _fitted(keras.Model, {}, make, rows[:40], targets[:40], jit)
    skipped, history = _fitted(
        kg.KeepGradModel, {"skip_bad_steps": skipping}, make, rows, targets, jit
    )
    assert history.history["skipped_steps"] == [2.0]
    # The weights and every optimizer variable, the iteration count too.
    assert skipped == plain


@pytest.mark.backends(
    "tensorflow",
    reason="XLA's selected writes; JAX's jitted step is the test above's, and "
    "PyTorch's update runs eagerly under torch.compile, beside the keeping",
)
@pytest.mark.parametrize("make", KERAS_OPTIMIZERS.values(), ids=KERAS_OPTIMIZERS)
def test_keras_optimizers_skip_exactly_in_xla_steps(make):
    """As above under XLA (`jit_compile=True`), against the same skipping
    model after the five good batches (XLA rounds some updates otherwise
    than plain Keras's XLA step): a second `fit` on the two bad batches
    runs the same compiled step, its writes selected, and changes no bit."""
    rows, targets, skipping = _with_bad_batches()
    options = {"skip_bad_steps": skipping}
    five, history = _fitted(kg.KeepGradModel, options, make, rows[:40], targets[:40], True)
    model = history.model
    compiled = model.train_function
    bad = model.fit(rows[40:], targets[40:], batch_size=8, shuffle=False, verbose=0)
    assert model.train_function is compiled
    assert (history.history["skipped_steps"], bad.history["skipped_steps"]) == ([0.0], [2.0])
    assert cases.state_bytes(model) == five


@pytest.mark.backends(
    "tensorflow", "torch", reason="JAX's `stateless_apply` updates every trainable variable"
)
@pytest.mark.not_compiled_on_torch(
    reason="the update runs eagerly: test_skipping[jit-nan_step_leaves_the_state_bit_identical]"
)
@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_jit", "jit"])
def test_an_update_of_some_variables_with_ema_skips_them_all(jit_compile):
    """An own step applies layer a's gradients only; the optimizer, built
    for a and b, overwrites every variable it was built for with its
    moving average (`ema_overwrite_frequency=1`), b included: b, set to
    5 after the first step, would go back to its average. A NaN step
    leaves it at 5."""

    class OnlyA(kg.KeepGradModel):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            loss, variables, grads = mse_gradients(
                self, x, y, self.get_layer("a").trainable_variables
            )
            self.optimizer.apply(grads, variables)
            return {"loss": loss}

    inputs = keras.Input((1,))
    hidden = keras.layers.Dense(1, use_bias=False, name="a")(inputs)
    model = OnlyA(inputs, keras.layers.Dense(1, name="b")(hidden), skip_bad_steps=True)
    optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_overwrite_frequency=1)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    optimizer.build(model.trainable_variables)
    with pytest.warns(UserWarning, match=r"passed no gradient for .*\['b/kernel', 'b/bias'\]"):
        model.fit(X, Y, batch_size=2, verbose=0)
    model.get_layer("b").kernel.assign([[5.0]])
    before = cases.state_bytes(model)
    # Not `fit`, which ends by writing the averages into every variable.
    logs = model.train_on_batch(cases.NAN_X, Y, return_dict=True)
    assert logs["skipped_steps"] == 1.0
    assert cases.state_bytes(model) == before
    assert float(np.asarray(model.get_layer("b").kernel)[0, 0]) == 5.0


@pytest.mark.backends("tensorflow", reason="tf.distribute strategies")
def test_several_replicas_of_another_strategy_than_mirrored_are_refused():
    # `MirroredStrategy` skips (test_distribute_skipping.py); another
    # strategy of several replicas is refused before any step runs.
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = one_weight(skip_bad_steps=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match=r"CentralStorageStrategy of 2 replicas"):
        model.fit(X, Y, verbose=0)
    assert float(np.asarray(model.get_layer("dense_0").kernel)[0, 0]) == 3.0


class TwoApplies(kg.KeepGradModel):
    """Layers a and b (w = 1 each, in a row), mse. Its own step applies
    each variable's gradient in an `apply` of its own; on JAX, whose
    `stateless_apply` takes every variable, it applies all the gradients
    twice."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="a")
        self.b = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="b")

    def call(self, x):
        return self.b(self.a(x))

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return self._jax_step(*args)
        ((x, y),) = args
        loss, variables, grads = mse_gradients(self, x, y)
        for grad, variable in zip(grads, variables):
            self.optimizer.apply([grad], [variable])
        return {"loss": loss}

    def _jax_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        loss, grads = jax_mse_and_gradients(self, trainable, non_trainable, *data)
        for _ in range(2):
            trainable, optimizer_values = self.optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
        return {"loss": loss}, (trainable, non_trainable, optimizer_values, metrics_values)


def test_a_spike_factor_needs_one_apply_per_step(mode):
    model = TwoApplies(skip_bad_steps=kg.SkipBadSteps(spike_factor=10.0))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    model(X)  # built
    # Each `apply` gets some of the variables: built for all first.
    model.optimizer.build(model.trainable_variables)
    # Named as the step calls it.
    called = "`stateless_apply`" if BACKEND == "jax" else "`apply` or `apply_gradients`"
    with pytest.raises(ValueError, match=rf"called an optimizer's {called} more than once"):
        model.fit(X, Y, verbose=0)
    # Refused before any update, or, in a step run as it is called, with
    # the first `apply`'s (a = 1 - 0.1 * 5 = 0.5) put back: a, b = 1, 1.
    assert [float(np.asarray(v)[0, 0]) for v in model.trainable_variables] == [1.0, 1.0]
    # Non-finite checks judge each `apply` alone.
    model.skip_bad_steps = True
    history = model.fit(cases.NAN_X, Y, verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    assert [float(np.asarray(v)[0, 0]) for v in model.trainable_variables] == [1.0, 1.0]


class TwoOptimizers(kg.KeepGradModel):
    """Two one-weight layers, a and b (w = 3 each), on one input column
    each, y = 0, mse apiece: d/da = 3 (p^2 + q^2) for a's column (p, q).
    Its own step applies a's gradient with the compiled optimizer and b's
    with one of its own, as a GAN's step does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        constant = keras.initializers.Constant(3.0)
        self.a = keras.layers.Dense(1, use_bias=False, kernel_initializer=constant, name="a")
        self.b = keras.layers.Dense(1, use_bias=False, kernel_initializer=constant, name="b")
        self.b_optimizer = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.a(x[:, :1]) + self.b(x[:, 1:])

    def _each_loss(self, x, y):
        return [
            keras.ops.mean((layer(x[:, i : i + 1]) - y) ** 2)
            for i, layer in enumerate((self.a, self.b))
        ]

    def train_step(self, data):
        x, y = data
        if keras.backend.backend() == "torch":
            losses = self._each_loss(x, y)
            self.zero_grad()
            (losses[0] + losses[1]).backward()
            grads = [[v.value.grad for v in layer.trainable_weights] for layer in (self.a, self.b)]
        else:
            with tf.GradientTape(persistent=True) as tape:
                losses = self._each_loss(x, y)
            grads = [
                tape.gradient(loss, layer.trainable_weights)
                for loss, layer in zip(losses, (self.a, self.b))
            ]
        self.optimizer.apply(grads[0], self.a.trainable_weights)
        self.b_optimizer.apply(grads[1], self.b.trainable_weights)
        return {"a_loss": losses[0], "b_loss": losses[1]}


class TwoUpdates(kg.KeepGradModel):
    """Two one-weight layers, a and b (w = 3 each), on one input column
    each, y = 0, mse: for a row (p, q), d/da = 6 p (p + q) and d/db =
    6 q (p + q). Its own step makes two updates with the compiled
    optimizer, a's then b's, as a GAN's step does with two optimizers (on
    JAX, whose `stateless_apply` takes every variable, each update gets a
    zero gradient for the other variable)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        constant = keras.initializers.Constant(3.0)
        self.a = keras.layers.Dense(1, use_bias=False, kernel_initializer=constant, name="a")
        self.b = keras.layers.Dense(1, use_bias=False, kernel_initializer=constant, name="b")

    def call(self, x):
        return self.a(x[:, :1]) + self.b(x[:, 1:])

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            state, (x, y) = args
            trainable, non_trainable, optimizer_values, metrics_values = state
            loss, (grad_a, grad_b) = jax_mse_and_gradients(self, trainable, non_trainable, x, y)
            for grads in ([grad_a, grad_b * 0.0], [grad_a * 0.0, grad_b]):
                trainable, optimizer_values = self.optimizer.stateless_apply(
                    optimizer_values, grads, trainable
                )
            state = (trainable, non_trainable, optimizer_values, metrics_values)
            return {"loss": loss}, state
        ((x, y),) = args
        loss, variables, grads = mse_gradients(self, x, y)
        for grad, variable in zip(grads, variables):
            self.optimizer.apply([grad], [variable])
        return {"loss": loss}


def test_each_of_several_updates_a_step_is_judged_against_its_own_window(mode, tmp_path):
    """Window 2, factor 3, SGD(0) (the weights stay 3; each update that runs
    counts one iteration), one row (p, q) a step; the norm of an update is
    its one gradient's size. Rows (1, 9) twice: a 60, b 540, each in its
    own window. (4, 9): a 312 > 3 * 60, skipped; b 702 <= 3 * 540, applied.
    (1, 30): a 186 <= 3 * (312 + 60) / 2, applied; b 5580 > 3 * (702 +
    540) / 2, skipped. One window for both (median 300 from the second
    step) would have skipped b's last update only. The two bad steps' files
    hold each update's gradients and which update was bad."""
    config = kg.SkipBadSteps(
        spike_factor=3.0, window=2, updates_per_step=2, save_batches_to=str(tmp_path)
    )
    assert config.get_config()["updates_per_step"] == 2
    assert "updates_per_step" not in kg.SkipBadSteps(spike_factor=3.0).get_config()
    assert kg.SkipBadSteps.from_config(config.get_config()) == config
    rows = np.array([[1.0, 9.0], [1.0, 9.0], [4.0, 9.0], [1.0, 30.0]], "float32")
    model = TwoUpdates(skip_bad_steps=kg.SkipBadSteps(spike_factor=3.0, window=2))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    model(rows)  # built
    # Each `apply` gets one of the variables: built for both first.
    model.optimizer.build(model.trainable_variables)
    # Windows for one update: the first step's second `apply` raises.
    called = "`stateless_apply`" if BACKEND == "jax" else "`apply` or `apply_gradients`"
    match = rf"{called} more than once.*`updates_per_step=1`.*number of {called} calls"
    with pytest.raises(ValueError, match=match):
        model.fit(rows[:1], Y[:1], batch_size=1, verbose=0)
    assert cases.iterations(model) == 0
    model.skip_bad_steps = config
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **mode)
    model.optimizer.build(model.trainable_variables)
    history = model.fit(rows, np.zeros((4, 1), "float32"), batch_size=1, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [2.0]
    assert cases.iterations(model) == 8 - 2
    metric = model._skipped_metric
    state = {
        name: keras.ops.convert_to_numpy(variable).tolist()
        for name, variable in zip(metric.names, metric.state_variables())
    }
    # Each window its last two norms, oldest first; beside them only the
    # counts (steps skipped and run; `total`, the step number of a file).
    assert state["norms"] == [[312.0, 186.0], [702.0, 5580.0]]
    assert sorted(state) == ["norms", "skipped", "steps", "total"]
    a, b = model.a.kernel.path, model.b.kernel.path
    # On JAX each update is handed both variables, the other's gradient 0.
    zeros = keras.backend.backend() == "jax"
    for step, bad_updates, grads in [
        (3, [True, False], (312.0, 702.0)),
        (4, [False, True], (186.0, 5580.0)),
    ]:
        with np.load(tmp_path / f"bad_step_{step:08d}.npz") as saved:
            expected = {f"grad/0/{a}": grads[0], f"grad/1/{b}": grads[1]}
            if zeros:
                expected.update({f"grad/0/{b}": 0.0, f"grad/1/{a}": 0.0})
            found = {k: float(saved[k][0, 0]) for k in saved.files if k.startswith("grad/")}
            assert (found, saved["bad_updates"].tolist()) == (expected, bad_updates)
    assert sorted(os.listdir(tmp_path)) == ["bad_step_00000003.npz", "bad_step_00000004.npz"]


def test_skipping_is_set_on_a_model_of_your_own_after_it_was_built(mode):
    """Keras locks a subclass's state once built; skipping's is made anyway.
    A row (1, NaN) makes both gradients NaN: both updates are skipped, the
    step counted once, the weights left at 3."""
    model = TwoUpdates()
    model(np.zeros((1, 2), "float32"))  # built
    model.skip_bad_steps = True
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **mode)
    model.optimizer.build(model.trainable_variables)
    history = model.fit(np.array([[1.0, np.nan]], "float32"), Y[:1], verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    assert [float(keras.ops.convert_to_numpy(v)[0, 0]) for v in model.trainable_variables] == [
        3.0,
        3.0,
    ]
    assert cases.iterations(model) == 0


@pytest.mark.backends(
    "tensorflow", "torch", reason="a JAX step carries one optimizer's state (Keras's JAX trainer)"
)
def test_a_step_with_one_of_two_updates_skipped_counts_as_skipped():
    """b's column holds a NaN: b's update is skipped (b stays 3, its
    optimizer's iteration count 0), a's runs (d/da = 3 (1 + 4) = 15, SGD(0.1):
    a = 1.5, count 1), and the step counts once in `skipped_steps`."""
    model = TwoOptimizers(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    x = np.array([[1.0, np.nan], [2.0, 1.0]], "float32")
    model(x)
    model.b_optimizer.build(model.b.trainable_weights)
    history = model.fit(x, Y, batch_size=2, verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    weights = [
        float(keras.ops.convert_to_numpy(layer.kernel)[0, 0]) for layer in (model.a, model.b)
    ]
    assert weights == [1.5, 3.0]
    assert (cases.iterations(model), int(model.b_optimizer.iterations)) == (1, 0)


EMPTY = _spikes.EMPTY
# Window 4, oldest first (`EMPTY`: no norm recorded there yet):
# `(squares, finite, norms, factor)`, then what the rule gives:
# `(spiked, norms)` after it.
SPIKE_RULE_CASES = {
    # Median (2 + 2) / 2 = 2. The norm sqrt(4.84) and the bound 1.1 * 2 are
    # both float32(2.2) = 2.2000000477: no spike. In float64 the bound would
    # be 2.2 and the norm above it. The norm joins at the end, the oldest
    # (1) leaves.
    "at_the_float32_bound": (
        ([4.84], True, [1.0, 2.0, 2.0, 3.0], 1.1),
        (False, [2.0, 2.0, 3.0, np.float32(2.2)]),
    ),
    # sqrt(4.9) = 2.2135944 > 2.2000000477: a spike, which joins the window.
    "above_it": (
        ([4.9], True, [1.0, 2.0, 2.0, 3.0], 1.1),
        (True, [2.0, 2.0, 3.0, np.float32(np.sqrt(np.float32(4.9)))]),
    ),
    # 3 norms recorded of 4: no median yet, whatever the norm.
    "window_not_full": (
        ([1e6], True, [EMPTY, 1.0, 1.0, 1.0], 2.0),
        (False, [1.0, 1.0, 1.0, 1000.0]),
    ),
    # Norms of 0 are recorded norms: the window is full, its median 0, and
    # any norm above 0 spikes.
    "full_of_zeros": (
        ([1.0], True, [0.0, 0.0, 0.0, 0.0], 2.0),
        (True, [0.0, 0.0, 0.0, 1.0]),
    ),
    # Non-finite gradients: the window is left as it was.
    "not_finite": (
        ([np.nan], False, [1.0, 2.0, 2.0, 3.0], 2.0),
        (False, [1.0, 2.0, 2.0, 3.0]),
    ),
    # 3e38 + 3e38 overflows float32: the median and the bound are inf.
    "median_overflows": (
        ([1.0], True, [3e38, 3e38, 3e38, 3e38], 2.0),
        (False, [3e38, 3e38, 3e38, 1.0]),
    ),
    # A finite step whose sum of squares overflows: its norm is inf, above
    # every bound, and does not join the window.
    "squares_overflow": (
        ([3e38, 3e38], True, [1.0, 2.0, 2.0, 3.0], 2.0),
        (True, [1.0, 2.0, 2.0, 3.0]),
    ),
}


@pytest.mark.parametrize("name", SPIKE_RULE_CASES)
def test_the_spike_rule_on_the_host_is_the_float32_one(name):
    (squares, finite, norms, factor), expected = SPIKE_RULE_CASES[name]
    results = []
    for a in (_spikes.TENSORS, _spikes.HOST):
        before = keras.ops.convert_to_tensor(np.array(norms, "float32"))
        squares_tensor = keras.ops.convert_to_tensor(np.array(squares, "float32"))
        finite_tensor = keras.ops.convert_to_tensor(finite)
        spiked, updated = _spikes.spike(a, squares_tensor, finite_tensor, before, factor, window=4)
        after = np.array(keras.ops.convert_to_numpy(updated), "float32").tolist()
        results.append((bool(keras.ops.convert_to_numpy(spiked)), after))
    tensors, host = results
    assert host == tensors
    spiked, norms_after = expected
    assert tensors == (spiked, np.array(norms_after, "float32").tolist())


def test_config_and_saving_round_trip(tmp_path):
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(spike_factor=4.0, window=7))
    assert model.get_config()["skip_bad_steps"] == {
        "nonfinite": True,
        "spike_factor": 4.0,
        "window": 7,
    }
    assert "skip_bad_steps" not in one_weight().get_config()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.skip_bad_steps == kg.SkipBadSteps(spike_factor=4.0, window=7)
    # The window is a metric's state, which Keras does not save: one norm
    # (5 * 3 = 15) recorded before, none after.
    windows = [keras.ops.convert_to_numpy(m._skipped_metric.norms) for m in (model, loaded)]
    assert [w.tolist() for w in windows] == [[-1.0] * 6 + [15.0], [-1.0] * 7]
    history = loaded.fit(np.array([[np.nan], [2.0]], "float32"), Y, verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    assert float(keras.ops.convert_to_numpy(loaded.weights[0])[0, 0]) == 1.5


def test_keep_gradients_wrapper_takes_the_option():
    plain = one_weight(cls=keras.Model)
    model = kg.keep_gradients(plain, skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(np.array([[np.nan], [2.0]], "float32"), Y, verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    assert float(keras.ops.convert_to_numpy(plain.weights[0])[0, 0]) == 3.0


def test_tensorboard_marks_the_skipped_steps(tmp_path):
    """Batches 1, NaN, 1, NaN: steps 2 and 4 are marked, once each, with
    the default `update_freq="epoch"` too."""
    log_dir = str(tmp_path / "logs")
    model = one_weight(skip_bad_steps=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    nan = np.array([[np.nan], [2.0]], "float32")
    model.fit(
        np.concatenate([X, nan, X, nan]),
        np.zeros((8, 1), "float32"),
        batch_size=2,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[kg.callbacks.GradientTensorBoard(log_dir)],
    )
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "logs" / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    marks = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(_skipped.TAG)]
    assert marks == [(2, 1.0), (4, 1.0), (6, 1.0), (8, 1.0)]
    epochs = [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors("epoch_skipped_steps")]
    assert epochs == [2.0, 2.0]


def test_the_docs_example_runs_and_prints_its_comments(capsys):
    with open(os.path.join(REPO, "docs", "skipping.md")) as f:
        text = f.read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "docs/skipping.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == ["[2.0]", "4"]


def test_saving_arguments_are_checked_and_round_trip(tmp_path):
    with pytest.raises(
        ValueError, match=r"`max_saved` must be a positive int. Received: max_saved=0"
    ):
        kg.SkipBadSteps(save_batches_to=str(tmp_path), max_saved=0)
    with pytest.raises(TypeError, match=r"Received: save_batches_to=3 of type int"):
        kg.SkipBadSteps(save_batches_to=3)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"`save_batches_to` must be a path this process can"):
        kg.SkipBadSteps(save_batches_to=str(blocker / "bad"))
    config = kg.SkipBadSteps(save_batches_to=tmp_path / "bad", max_saved=3)
    assert config.get_config() == {
        "nonfinite": True,
        "spike_factor": None,
        "window": 100,
        "save_batches_to": str(tmp_path / "bad"),
        "max_saved": 3,
    }
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.models.load_model(path).skip_bad_steps == config


def test_replay_refuses_other_files_and_uncompiled_models(tmp_path):
    path = str(tmp_path / "other.npz")
    np.savez(path, a=np.zeros(1))
    model = one_weight()
    with pytest.raises(ValueError, match=r"holds no `x` \(its keys: \['a'\]\)"):
        kg.replay_batch(model, path)
    np.savez(path, x=X, y=Y)
    with pytest.raises(ValueError, match=r"not compiled with a loss"):
        kg.replay_batch(model, path)


def test_a_nested_batch_is_refused_with_its_name(tmp_path):
    model = one_weight(skip_bad_steps=kg.SkipBadSteps(save_batches_to=str(tmp_path)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    match = r"Received a nested 'x'"
    if keras.backend.backend() != "tensorflow":
        # Keras's JAX and PyTorch trainers run the model's input checks on
        # the batch before our step sees it, and refuse the unknown key first.
        match = r"You passed a data dictionary with keys \['a'\]"
    with pytest.raises(ValueError, match=match):
        model.train_on_batch({"a": {"b": X}}, Y)


def test_flagging_round_trips_and_its_count_is_never_the_skipped_one(tmp_path):
    config = kg.SkipBadSteps(spike_factor=4.0, skip=False)
    assert config.get_config() == {
        "nonfinite": True,
        "spike_factor": 4.0,
        "window": 100,
        "skip": False,
    }
    assert kg.SkipBadSteps.from_config(config.get_config()) == config
    assert config != kg.SkipBadSteps(spike_factor=4.0)
    model = one_weight(skip_bad_steps=config)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.skip_bad_steps == config
    # Flagged, applied: w turns NaN. Set to skip: the same step is skipped.
    nan = np.array([[np.nan], [2.0]], "float32")
    history = loaded.fit(nan, Y, verbose=0)
    assert sorted(history.history) == ["flagged_steps", "loss"]
    assert history.history["flagged_steps"] == [1.0]
    assert np.isnan(float(loaded.weights[0].numpy()[0, 0]))
    model.skip_bad_steps = kg.SkipBadSteps(spike_factor=4.0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(nan, Y, verbose=0)
    assert sorted(history.history) == ["loss", "skipped_steps"]
    assert history.history["skipped_steps"] == [1.0]
    assert float(model.weights[0].numpy()[0, 0]) == 3.0
