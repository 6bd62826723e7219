"""`KeepGradModel` and `keep_gradients()`: what users call."""

import collections
import contextlib
import functools
from typing import Any

import keras

from keras_keepgrad import _capture
from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _replicas
from keras_keepgrad import _saving
from keras_keepgrad import _skipping
from keras_keepgrad import _torch_compile
from keras_keepgrad import backend
from keras_keepgrad.metrics import compiled as grad_metrics

__all__ = ["FunctionalKeepGradModel", "KeepGradModel"]

# What `KeepGradModel.kept_step` returns.
KeptStep = collections.namedtuple("KeptStep", ["paths", "write", "age"])


def _keeping(train_step, own=False):
    """`train_step`, run as a step whose optimizers' gradients are kept.

    A step that calls another (`super().train_step(data)`) is one step.
    `own`: whether it is a subclass's own step rather than Keras's.
    """

    @functools.wraps(train_step)
    def keeping(self, *args, **kwargs):
        # `(data)` on TensorFlow and PyTorch, `(state, data)` on JAX.
        with (
            _torch_compile.eager_context(_restoring_context, self),
            _torch_compile.eager_context(_keeping_context, self),
        ):
            guard = _skipping.begin(self, args)
            if guard is None:
                return train_step(self, *args, **kwargs)
            return guard.finish(train_step(self, *args, **kwargs))

    # Under `torch.compile` the step's bookkeeping runs eagerly, and
    # `train_step` is compiled on its own.
    keeping = _torch_compile.eager_frame(keeping)
    keeping._keeps = True
    keeping._own_step = own
    return keeping


@_capture.do_not_convert  # a `tf.function` may convert `train_step`
def _keeping_context(model):
    """The context of one keeping step of `model`; none if it keeps nothing
    or is in its step already."""
    step = _capture.current_step()
    if not model._keep_gradients or (step is not None and step.model is model):
        return contextlib.nullcontext()
    # Done by `make_train_function`, unless the step is called alone.
    _capture.install(again=False, methods=backend.CAPTURED_METHODS)
    if model._keeper is None:
        model._keeper = model._new_keeper()
    return _capture.training_step(model, model._keeper)


@_capture.do_not_convert
def _restoring_context(model):
    """Restores `model`'s state if its first eagerly run step raises.

    A gradient metric raises in the step, after the optimizers updated the
    variables (a step that kept nothing, an `fn` that fails or returns no
    scalar): on the first step of a training function, the error leaves
    the model as it was. A traced step raises while it is traced, before
    anything runs, and JAX's steps are pure (`backend/jax.py` puts their
    state back), so only eager PyTorch and TensorFlow steps need the copy
    (`_restores_state_on_error`).
    """
    if not model._keep_gradients:
        return contextlib.nullcontext()
    step = _capture.current_step()
    if step is not None and step.model is model:
        return contextlib.nullcontext()  # a step that calls another
    keeper = model._keeper
    if keeper is not None and keeper.ran_a_step:
        return contextlib.nullcontext()
    if not model._restores_state_on_error():
        return contextlib.nullcontext()
    if not grad_metrics.gradient_metrics(model):
        return contextlib.nullcontext()
    return _restored_on_error(model)


@contextlib.contextmanager
def _restored_on_error(model):
    """Copies `model`'s state; puts it back if the block raises."""
    optimizers = [
        value for value in vars(model).values() if isinstance(value, keras.optimizers.Optimizer)
    ]
    if getattr(model, "optimizer", None) is not None:
        optimizers.append(model.optimizer)
    variables, seen = [], set()
    for variable in [
        *model.variables,
        *model.metrics_variables,
        *(v for optimizer in optimizers for v in optimizer.variables),
    ]:
        if id(variable) not in seen:
            seen.add(id(variable))
            variables.append(variable)
    values = [keras.ops.copy(v.value) for v in variables]
    restore_metrics = grad_metrics.untracked_state(model)
    try:
        yield
    except BaseException:
        # Metrics that the step built (eager TensorFlow builds the compiled
        # ones in the first step) start from their reset state.
        for metric in model.metrics:
            if any(id(v) not in seen for v in metric.variables):
                metric.reset_state()
        for variable, value in zip(variables, values):
            variable.assign(value)
        restore_metrics()
        raise


def _marking_evaluation(test_step):
    """`test_step`, run as an evaluation step (`_capture.evaluation_step`)."""

    @functools.wraps(test_step)
    def marked(self, *args, **kwargs):
        with _torch_compile.eager_context(_capture.evaluation_step):
            return test_step(self, *args, **kwargs)

    marked = _torch_compile.eager_frame(marked)
    marked._marks_evaluation = True
    return marked


# Under `torch.compile`, kept as in an eager step (`_torch_compile`).
@_torch_compile.eager
def _keep_given(model, grads, variables):
    """What `KeepGradModel.keep_step_gradients` does."""
    grads, variables = list(grads), list(variables)
    step = _capture.current_step()
    if not model._keep_gradients:
        raise RuntimeError(
            f"Model {model.name!r} does not keep gradients, so "
            "`keep_step_gradients()` has nothing to keep them in. Build "
            "it with `keep_gradients=True`."
        )
    if step is None or step.model is not model:
        raise RuntimeError(
            "`keep_step_gradients()` keeps the gradients of a training "
            f"step of model {model.name!r}: call it from its `train_step` "
            "(run by `fit` or `train_on_batch`)."
        )
    if len(grads) != len(variables):
        raise ValueError(
            "`grads` and `variables` must have one entry per variable. "
            f"Received: {len(grads)} gradients for {len(variables)} "
            "variables."
        )
    step.claim(variables)
    step.before_update()
    return step.keeper.keep_given(step, variables, grads)


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class KeepGradModel(backend.Trainer, keras.Model):
    """A `keras.Model` that keeps each training batch's gradients.

    Use it exactly like `keras.Model`: functional construction, subclassing,
    `compile`, `fit`, callbacks and saving all work as they do there. After
    each training batch, `model.gradients` holds the gradient of the loss
    with respect to every trainable variable: unscaled (dynamic
    `LossScaleOptimizer` scale and static `loss_scale_factor` divided out),
    before any optimizer transformation (clipping, weight decay, gradient
    accumulation, EMA), dense, and with the dtype the optimizer's update
    receives.

    The gradients are taken where an optimizer receives them (its `apply`,
    which `apply_gradients` calls), so a subclass's own `train_step` is
    kept too, with every optimizer it uses (a GAN's two): no code beyond
    subclassing. A step that updates variables without an optimizer passes
    its gradients through `keep_step_gradients` first.

    Args:
        keep_gradients: Bool. Keep each training batch's gradients. With
            False the model is a plain `keras.Model` in every variable, op
            and saved array. Defaults to `True`.
        save_gradients: Bool. Also write the kept gradients into Keras's own
            saved files (`.keras`, `.weights.h5`). Defaults to `False`.
        keep_every: Positive int. Write the slots on training steps 1,
            1 + N, 1 + 2N, ... only, to amortize their cost; in between,
            `model.gradients` holds the last written step's gradients.
            Gradient metrics still see every step. Defaults to `1`.
        skip_bad_steps: None or False (off), True (skip the optimizer
            update of steps whose kept gradients are non-finite), or a
            `keras_keepgrad.SkipBadSteps` (also gradient-norm spikes). A
            skipped step leaves the weights and the optimizer's state
            untouched, keeps its gradients, and is counted in the logs as
            `skipped_steps` (`SkipBadSteps(skip=False)` only flags bad
            steps: applied, counted as `flagged_steps`). Under
            `tf.distribute.MirroredStrategy` and
            `MultiWorkerMirroredStrategy` every replica judges the global
            gradients and skips alike. Off, the training step is
            unchanged. Defaults to None.
        **kwargs: Passed on to `keras.Model`.

    Raises:
        TypeError: `keep_gradients` or `save_gradients` is not a bool, or
            `skip_bad_steps` is none of the above.
        ValueError: `keep_every` is not a positive int; at `fit`, two
            trainable variables share a path (layers of the same `name`),
            or `skip_bad_steps` is set but gradients are not kept, or
            under a `tf.distribute` strategy of several replicas other
            than `MirroredStrategy` and `MultiWorkerMirroredStrategy`
            (under them, as the step is traced, with an optimizer that
            overrides more of Keras's than `update_step`, `build`,
            `__init__`, `get_config` and `from_config`).

    Examples:
        >>> import keras, numpy as np
        >>> import keras_keepgrad as kg
        >>> inputs = keras.Input((1,))
        >>> dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
        ...                            name="doc_dense")
        >>> model = kg.KeepGradModel(inputs, dense(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> history = model.fit(np.array([[1.0], [2.0]]), np.zeros((2, 1)),
        ...                     batch_size=2, verbose=0)

        loss = mean((w*x)^2), so d/dw = w * (1 + 4) = 5 at w = 1:

        >>> model.gradients["doc_dense"]["kernel"].numpy()
        array([[5.]], dtype=float32)
        >>> model.get_weights()[0]  # 1 - 0.1 * 5
        array([[0.5]], dtype=float32)
    """

    def __new__(cls, *args, **kwargs):
        if cls is KeepGradModel and _compat.functional_init_arguments(args, kwargs):
            # As `keras.Model(inputs, outputs)` returns a `Functional`.
            return super().__new__(FunctionalKeepGradModel)
        return super().__new__(cls)

    def __init__(
        self,
        *args: Any,
        keep_gradients: bool = True,
        save_gradients: bool = False,
        keep_every: int = 1,
        skip_bad_steps: Any = None,
        **kwargs: Any,
    ) -> None:
        _compat.check_backend(type(self).__name__)
        _checks.check_bool("keep_gradients", keep_gradients)
        _checks.check_bool("save_gradients", save_gradients)
        keep_every = _checks.check_keep_every(keep_every)
        skip_config = _skipping.config_of(skip_bad_steps)
        if _compat.functional_init_arguments(args, kwargs):
            if not isinstance(self, _compat.Functional):
                _inject_functional(type(self))
            # What `keras.Model.__init__` does for functional arguments, but
            # without its rewrite of every base class up to `keras.Model`,
            # which would turn `KeepGradModel` itself into a `Functional`
            # subclass and break `class Net(KeepGradModel)` afterwards.
            _compat.BackendTrainer.__init__(self)
            _compat.Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._keep_gradients = keep_gradients
        self._save_gradients = save_gradients
        self._keep_every = keep_every
        self._keeper = None
        self._skip_config = None
        self._skipped_metric = None
        self._set_skip_config(skip_config)
        self._init_backend_state()

    @property
    def keep_gradients(self):
        """Bool. Whether training keeps each batch's gradients."""
        return self._keep_gradients

    @keep_gradients.setter
    def keep_gradients(self, value):
        value = _checks.check_bool("keep_gradients", value)
        if value:
            self._check_keeping_allowed()  # before anything changes
        if value != self._keep_gradients:
            # The training function is traced with or without keeping.
            self.train_function = None
        self._keep_gradients = value

    @property
    def save_gradients(self):
        """Bool. Whether Keras's saved files include the kept gradients."""
        return self._save_gradients

    @save_gradients.setter
    def save_gradients(self, value):
        self._save_gradients = _checks.check_bool("save_gradients", value)

    @property
    def keep_every(self):
        """Int. Slots are written on training steps 1, 1 + N, 1 + 2N, ..."""
        return self._keep_every

    @keep_every.setter
    def keep_every(self, value):
        value = _checks.check_keep_every(value)
        if value != self._keep_every:
            self.train_function = None
        self._keep_every = value

    @property
    def skip_bad_steps(self):
        """The `SkipBadSteps` that training follows, or None (off).

        Set it to None, False, True or a `SkipBadSteps`, as the
        constructor's argument; the next `fit` follows it.
        """
        return self._skip_config

    @skip_bad_steps.setter
    def skip_bad_steps(self, value):
        config = _skipping.config_of(value)
        if config != self._skip_config:
            # The training function is traced with or without skipping.
            self.train_function = None
            self._set_skip_config(config)

    def _set_skip_config(self, config):
        self._skip_config = config
        metric = self._skipped_metric
        counts = config is not None and config.save_batches_to is not None
        if (
            config is None
            or metric is None
            or metric.window != config.window
            or metric.updates != config.updates_per_step
            or metric.counts_steps != counts
            or metric.name != config.log_key
        ):
            # Its state: made only where skipping is on, so that a model
            # that does not skip has no variable or metric more.
            # Replacing one (its state made anew), also on a built model.
            _compat.set_metric(
                self,
                "_skipped_metric",
                None
                if config is None
                else _skipping.SkippedSteps(
                    config.window, counts, name=config.log_key, updates=config.updates_per_step
                ),
            )

    def get_config(self):
        config = super().get_config()
        config.update(
            keep_gradients=self._keep_gradients,
            save_gradients=self._save_gradients,
            keep_every=self._keep_every,
        )
        if self._skip_config is not None:
            config["skip_bad_steps"] = self._skip_config.get_config()
        return config

    # Training ----------------------------------------------------------

    def compile(self, *args, **kwargs):
        self._check_compile_arguments(args, kwargs)
        super().compile(*args, **kwargs)

    compile.__doc__ = keras.Model.compile.__doc__

    def compile_from_config(self, config):
        # Keras's own skips compiling a model whose class overrides
        # `compile`, as this one does: the same steps, for a `compile` that
        # only adds a check. A user's subclass with its own `compile` gets
        # Keras's behaviour (a warning, and no compile).
        if type(self).compile is not KeepGradModel.compile:
            return super().compile_from_config(config)
        config = self._compile_config_made_elsewhere(
            keras.saving.deserialize_keras_object(config), "The loaded model"
        )
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            # As Keras: the optimizer's variables, for its loaded state.
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        # Before anything changes: a gradient metric would raise in the
        # first step (its updates on PyTorch and eager TensorFlow applied).
        grad_metrics.check_gradients_kept(self)
        if self._skip_config is not None:
            _skipping.check_allowed(self)
        if self._keep_gradients:
            # Before `fit` runs a step (on JAX, before it takes the variables'
            # values out of the model for the step): each step checks again.
            _checks.check_unique_paths(self, self.trainable_variables)
            grad_metrics.check_unique_keys(self)
            _capture.install(methods=backend.CAPTURED_METHODS)
            # Fresh slots, made as the new training function is first
            # traced, from what its optimizers receive.
            self._keeper = self._new_keeper()
            grad_metrics.build_gradient_metrics(self)
            self._metrics_built_for = self._trainable_paths()
            # `UpdateRatio` compares each update's before and after.
            self._keeper.record_updates = grad_metrics.measures_updates(self)
            return self._make_keeping_train_function(force)
        return super().make_train_function(force=force)

    def _trainable_paths(self):
        return tuple(v.path for v in self.trainable_variables)

    def _before_first_update(self):
        """Before a training step's first update: the model is built now.

        A model built by its first batch (a subclass without `Input`, on
        TensorFlow) had no variables when `make_train_function` checked and
        built the gradient metrics: per-layer keys were unknown, and
        `UpdateRatio` had no copy of the weights before the update. Done
        again here, before anything is updated.
        """
        built_for = getattr(self, "_metrics_built_for", None)
        if built_for is None:
            return
        self._metrics_built_for = None  # once per training function
        if built_for != self._trainable_paths():
            grad_metrics.check_unique_keys(self)
            grad_metrics.build_gradient_metrics(self)

    def keep_step_gradients(self, grads: list, variables: list) -> list:
        """Keeps gradients that a training step applies without an optimizer.

        Call it from your own `train_step`, for variables that you update by
        hand: `grads` are kept as given, with the semantics of the
        gradients an optimizer receives (a None gradient is kept as zeros,
        sparse ones densified on read), and are in `model.gradients` and
        the gradient metrics of this step. Use the returned gradients for
        the update, so that each slot is written before its variable
        changes.

        Args:
            grads: List of gradient tensors (or None), one per variable.
            variables: List of the variables they are gradients of.

        Returns:
            The list of gradients, to update the variables with.

        Raises:
            RuntimeError: Called outside this model's training step, or the
                model keeps no gradients.
            ValueError: `grads` and `variables` differ in length, or one
                of `variables` shares its path with another variable of
                the model or of the step.

        Example:

        ```python
        class Net(kg.KeepGradModel):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss = keras.ops.mean((self(x) - y) ** 2)
                variables = self.trainable_variables
                grads = self.keep_step_gradients(
                    tape.gradient(loss, variables), variables)
                for v, g in zip(variables, grads):
                    v.assign_sub(0.1 * g)
                return {"loss": loss}
        ```
        """
        return _keep_given(self, grads, variables)

    # Whoever wrote `train_step`, it runs as a step whose optimizers'
    # gradients are kept; gradient metrics skip evaluation steps.
    train_step = _keeping(keras.Model.train_step)
    test_step = _marking_evaluation(keras.Model.test_step)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass's own steps are wrapped alike, wherever they are defined:
        # on the class or on a mixin before `KeepGradModel` in its bases.
        step = getattr(cls, "train_step")
        if not getattr(step, "_keeps", False):
            cls.train_step = _keeping(step, own=True)
        step = getattr(cls, "test_step")
        if not getattr(step, "_marks_evaluation", False):
            cls.test_step = _marking_evaluation(step)

    # Saving ------------------------------------------------------------

    @property
    def _kept_gradients(self):
        # Keras's saving walks `dir(model)`: this saveable writes the kept
        # gradients into `.keras` / `.weights.h5` files only with
        # `save_gradients=True`, and loading restores them (`_saving.py`).
        return _saving.kept_gradients_state(self)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        # Keras loads every other saveable before it raises a saveable's
        # error: check the saved gradients first, so that a mismatch leaves
        # the weights and the optimizer untouched.
        if self._keep_gradients and self.built and not skip_mismatch:
            _saving.check_gradients_in_file(self, filepath)
        return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    # Reading -----------------------------------------------------------

    def _checked_keeper(self):
        if not self._keep_gradients:
            raise AttributeError(
                f"Model {self.name!r} does not keep gradients. Build it with "
                "`keep_gradients=True` (or set `model.keep_gradients = True` "
                "and train again)."
            )
        keeper = self._keeper
        if keeper is None or not keeper.built:
            raise RuntimeError(
                f"Model {self.name!r} has no kept gradients yet: train it first "
                "(`fit` or `train_on_batch`); they are there from the end of "
                "the first training step."
            )
        if keeper.kept_nothing:
            raise RuntimeError(_checks.nothing_kept_message(self))
        stale = _checks.stale_gradients_message(self)
        if stale is not None:
            raise RuntimeError(stale)
        return self._keeper

    @property
    def gradients(self):
        """The last training batch's gradients, nested like the variables.

        A nested dict with the structure of
        `model.get_state_tree()["trainable_variables"]`, whose leaves are
        dense tensors. A functional sub-model adds no level of its own (its
        layers' variable paths do not hold its name): `get_gradients_of`
        picks out one sub-model's gradients.

        Raises:
            AttributeError: The model was built with `keep_gradients=False`.
            RuntimeError: The model was not trained yet, or its trainable
                variables changed since the training function was built.
        """
        return _capture.nest_by_path(self._checked_keeper().read())

    @property
    def gradient_dtypes(self):
        """`{variable path: dtype}` of the kept gradients (flat).

        A `tf.DType` on TensorFlow, a NumPy dtype on JAX and PyTorch; all
        compare equal to dtype names (`"float32"`).
        """
        return self._checked_keeper().slot_dtypes()

    def get_gradients_by_path(self):
        """The last training batch's gradients as `{variable path: tensor}`."""
        return self._checked_keeper().read()

    @property
    def kept_step(self):
        """Which training step the kept gradients come from, or None.

        Never raises, unlike `gradients`: a callback reads it between steps
        to tell whether there is anything new to read. None before the
        first step of the training function (or with `keep_gradients=False`),
        else a named tuple `KeptStep(paths, write, age)`:

        - `paths`: Tuple of the variable paths whose gradients that step
          kept, in `model.trainable_variables` order (the keys of
          `get_gradients_by_path()`); `()` when the step passed no gradient
          to any optimizer.
        - `write`: Equal values, the same kept gradients. None with
          `keep_every=1`, where every training step writes them.
        - `age`: Int. Training steps run since the kept one: 0 for the
          last step's gradients, at most `keep_every - 1`.
        """
        keeper = self._keeper
        if not self._keep_gradients or keeper is None or not keeper.built:
            return None
        write, age = keeper.last_write()
        return KeptStep(keeper.paths, write, age)

    @property
    def first_bad_replica(self) -> int | None:
        """The first replica whose gradients of the kept step were not finite.

        Under a `tf.distribute` strategy with several replicas (e.g.
        `MirroredStrategy`), each replica computes a partial gradient on its
        share of the global batch, and the kept gradients are their sum:
        a NaN or an infinity in one share spreads to the sum. Each
        replica's step notes whether its own partial gradients held one,
        before they are all-reduced, at no communication cost; this reads
        the notes of the step the gradients were kept at. Under
        `keras.distribution.DataParallel` on JAX, where the devices'
        partial gradients never exist apart, a step whose kept gradients
        are not finite replays each device's rows alone, where the model
        judges its steps (`skip_bad_steps`) with Keras's own `train_step`
        (see `docs/distributed.md`).

        Returns:
            The smallest replica index (`replica_id_in_sync_group`, the
                order in which the strategy splits the batch: replica 0
                gets its first rows; the device's index in the
                distribution's mesh on JAX) whose partial gradients held a
                NaN or an infinity; 0 on one replica (or without a
                strategy) if the kept gradients hold one. None if no
                replica's did (under several replicas a sum of finite
                shares can still overflow).

        Raises:
            AttributeError, RuntimeError: As `gradients`. Also
                RuntimeError where the kept gradients are not finite under
                `keras.distribution` on several JAX devices and no device
                was replayed (no `skip_bad_steps`, a `train_step` of the
                user's own, a model that cannot run on one device's rows,
                or a distribution other than `DataParallel`); it says
                which.
        """
        return _replicas.first_bad_replica(self, self._checked_keeper())

    def get_gradients_of(self, layer: keras.layers.Layer) -> dict:
        """The last training batch's gradients of one layer or sub-model.

        The kept gradients of exactly `layer`'s trainable variables (the
        layers inside it included), as `{variable path: tensor}` like
        `get_gradients_by_path()`. Use it to tell sub-models apart: the
        paths of a functional sub-model's variables do not start with its
        name (only `Sequential` and subclassed models add theirs), so
        `model.gradients` alone does not say which sub-model a key belongs
        to. A trainable variable of `layer` whose gradient the last step did
        not keep (no optimizer received it) is absent, as it is from
        `model.gradients`.

        Args:
            layer: A `keras.layers.Layer` or `keras.Model` of this model: a
                layer or sub-model that it calls, at any depth (such as
                `model.get_layer(name)`, or the attribute holding a
                sub-model), or the model itself.

        Returns:
            A flat dict `{variable path: tensor}` in `layer`'s variable
                order, with the same keys and values as the model's own
                `get_gradients_by_path()` for these variables.

        Raises:
            TypeError: `layer` is not a Keras layer.
            ValueError: `layer` is not a layer of this model, has no
                trainable variables in it, or none of its gradients were
                kept at the last training step.
            AttributeError: The model was built with `keep_gradients=False`.
            RuntimeError: The model was not trained yet, or its trainable
                variables changed since the training function was built.

        Examples:
            >>> import keras, numpy as np
            >>> import keras_keepgrad as kg
            >>> def sub_model(name, w):
            ...     inputs = keras.Input((1,))
            ...     dense = keras.layers.Dense(1, use_bias=False, name=f"{name}_dense",
            ...         kernel_initializer=keras.initializers.Constant(w))
            ...     return keras.Model(inputs, dense(inputs), name=name)
            >>> encoder, decoder = sub_model("encoder", 3.0), sub_model("decoder", 1.0)
            >>> inputs = keras.Input((1,))
            >>> model = kg.KeepGradModel(inputs, decoder(encoder(inputs)))
            >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            >>> history = model.fit(np.array([[1.0], [2.0]]), np.zeros((2, 1)),
            ...                     batch_size=2, verbose=0)

            Functional sub-models add no level of their own to the keys:

            >>> sorted(model.gradients)
            ['decoder_dense', 'encoder_dense']

            loss = mean((d*e*x)^2), so d/de = 5 e d^2 = 15 at e = 3, d = 1:

            >>> {p: float(g[0, 0]) for p, g in model.get_gradients_of(encoder).items()}
            {'encoder_dense/kernel': 15.0}
            >>> {p: float(g[0, 0]) for p, g in model.get_gradients_of(decoder).items()}
            {'decoder_dense/kernel': 45.0}
        """
        if not isinstance(layer, keras.layers.Layer):
            hint = (
                f" To look a layer up by name, pass `model.get_layer({layer!r})`."
                if isinstance(layer, str)
                else ""
            )
            raise TypeError(
                "`layer` must be a layer or sub-model of this model (a "
                f"`keras.layers.Layer` or `keras.Model`).{hint} Received: "
                f"layer={layer!r} of type {type(layer).__name__}"
            )
        # Matched by identity, not by path or name: the model's own variable
        # objects are the kept gradients' keys.
        own = {id(v) for v in self.variables}
        variables = [v for v in layer.variables if id(v) in own]
        if not variables:
            if layer.variables:
                raise ValueError(
                    f"`layer` {layer.name!r} is not a layer of model "
                    f"{self.name!r}: none of its variables are the model's. "
                    "Pass a layer or sub-model that this model calls (one of "
                    "`model.layers`, or a layer inside one of them), or call "
                    "`get_gradients_of` on the model that holds it. Received: "
                    f"layer={layer!r}"
                )
            raise ValueError(
                f"`layer` {layer.name!r} has no variables, so it has no "
                "gradients: it has no weights (such as `Flatten`), or it is "
                "not built yet. Pass a layer or sub-model with trainable "
                f"weights. Received: layer={layer!r}"
            )
        paths = {id(v): v.path for v in self.trainable_variables}
        trainable = [paths[id(v)] for v in layer.trainable_variables if id(v) in paths]
        if not trainable:
            raise ValueError(
                f"`layer` {layer.name!r} has no trainable variables in model "
                f"{self.name!r}, so it has no kept gradients: it has no "
                "trainable weights (such as `Dropout`), or it or a model "
                f"holding it is frozen (`trainable=False`). Received: layer={layer!r}"
            )
        kept = self.get_gradients_by_path()
        gradients = {path: kept[path] for path in trainable if path in kept}
        if not gradients:
            raise ValueError(
                f"No gradient of `layer` {layer.name!r} was kept at the last "
                "training step: no optimizer received the gradients of its "
                f"trainable variables {trainable}. Apply an optimizer to them "
                "in `train_step`, or pass their gradients through "
                "`keep_step_gradients`."
            )
        return gradients


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class FunctionalKeepGradModel(KeepGradModel, _compat.Functional):
    """What `KeepGradModel(inputs, outputs)` builds, as `keras.Model` builds
    a `Functional`."""


def _inject_functional(cls):
    """Puts `Functional` under a user's subclass built from inputs/outputs.

    Like Keras's `inject_functional_model_class`, but it stops at
    `KeepGradModel` (replaced by `FunctionalKeepGradModel`) instead of
    rewriting `KeepGradModel` itself.
    """
    if cls is KeepGradModel:
        return FunctionalKeepGradModel
    if cls is object or not issubclass(cls, KeepGradModel):
        return cls
    cls.__bases__ = tuple(_inject_functional(base) for base in cls.__bases__)
    return cls


# Keras's legacy `.h5` format records a model's bare class name, and its
# loader looks that up among the global custom objects (not the
# package-qualified names registered above): so `load_model("m.h5")` finds
# these classes without `custom_objects`, as it finds Keras's own.
for _cls in (KeepGradModel, FunctionalKeepGradModel):
    keras.saving.get_custom_objects().setdefault(_cls.__name__, _cls)
del _cls
