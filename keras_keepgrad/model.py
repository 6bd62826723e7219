"""`KeepGradModel` and `keep_gradients()`: what users call."""

import contextlib
import functools
import numbers
import os
import sys
import types
import warnings
from typing import Any

import keras
from keras import tree

from keras_keepgrad import _capture
from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _saving
from keras_keepgrad import _torch_compile

# The backend's keeping mechanism; the JAX and PyTorch ones do not import
# TensorFlow.
if _compat.BACKEND == "jax":
    from keras_keepgrad import _keeper_jax as _keeper
elif _compat.BACKEND == "torch":
    import torch

    from keras_keepgrad import _keeper_torch as _keeper
else:
    import tensorflow as tf

    from keras_keepgrad import _keeper
from keras_keepgrad import metrics as metrics_lib

__all__ = ["KeepGradModel", "keep_gradients"]

_OPTIONS = ("keep_gradients", "save_gradients", "keep_every")


def _check_keep_every(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            "`keep_every` must be a positive int (1 keeps every step). "
            f"Received: keep_every={value!r}"
        )
    return int(value)


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (keras.__file__, _keeper.__file__, __file__)
    + ((tf.__file__,) if _compat.BACKEND == "tensorflow" else ())
    + ((torch.__file__,) if _compat.BACKEND == "torch" else ())
)


def _user_stacklevel():
    """The `stacklevel` that makes a warning name the user's line.

    For `warnings.warn` in the calling function: it counts that function's
    frame as 1, then every frame of Keras, TensorFlow or this package
    above it (a setter reached through `compile` passes through several).
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _keeping(train_step):
    """`train_step`, run as a step whose optimizers' gradients are kept.

    A step that calls another (`super().train_step(data)`) is one step.
    """

    @functools.wraps(train_step)
    def keeping(self, *args, **kwargs):
        # `(data)` on TensorFlow and PyTorch, `(state, data)` on JAX.
        with _torch_compile.eager_context(_keeping_context, self):
            return train_step(self, *args, **kwargs)

    # Under `torch.compile` the step's bookkeeping runs eagerly, and
    # `train_step` is compiled on its own.
    keeping = _torch_compile.eager_frame(keeping)
    keeping._keeps = True
    return keeping


@_capture.do_not_convert  # a `tf.function` may convert `train_step`
def _keeping_context(model):
    """The context of one keeping step of `model`; none if it keeps nothing
    or is in its step already."""
    step = _capture.current_step()
    if not model._keep_gradients or (step is not None and step.model is model):
        return contextlib.nullcontext()
    # Done by `make_train_function`, unless the step is called alone.
    _capture.install(again=False)
    if model._keeper is None:
        model._keeper = model._new_keeper()
    return _capture.training_step(model, model._keeper)


def _marking_evaluation(test_step):
    """`test_step`, run as an evaluation step (`_keeper.evaluation_step`)."""

    @functools.wraps(test_step)
    def marked(self, *args, **kwargs):
        with _torch_compile.eager_context(_keeper.evaluation_step):
            return test_step(self, *args, **kwargs)

    marked = _torch_compile.eager_frame(marked)
    marked._marks_evaluation = True
    return marked


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class KeepGradModel(keras.Model):
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
        **kwargs: Passed on to `keras.Model`.

    Raises:
        TypeError: `keep_gradients` or `save_gradients` is not a bool.
        ValueError: `keep_every` is not a positive int; at `fit`, two
            trainable variables share a path (layers of the same `name`).

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
        **kwargs: Any,
    ) -> None:
        _compat.check_backend(type(self).__name__)
        _checks.check_bool("keep_gradients", keep_gradients)
        _checks.check_bool("save_gradients", save_gradients)
        keep_every = _check_keep_every(keep_every)
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
        # True only while `_make_function` wraps an XLA step. Held in a
        # namespace: a value set on a Keras layer is seen by its tracker.
        self._pending = types.SimpleNamespace(xla_inside_step=False)

    @property
    def keep_gradients(self):
        """Bool. Whether training keeps each batch's gradients."""
        return self._keep_gradients

    @keep_gradients.setter
    def keep_gradients(self, value):
        value = _checks.check_bool("keep_gradients", value)
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
        value = _check_keep_every(value)
        if value != self._keep_every:
            self.train_function = None
        self._keep_every = value

    def get_config(self):
        config = super().get_config()
        config.update(
            keep_gradients=self._keep_gradients,
            save_gradients=self._save_gradients,
            keep_every=self._keep_every,
        )
        return config

    # Training ----------------------------------------------------------

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if _compat.BACKEND != "tensorflow":
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        if iterator is not None and _compat.collective_multi_worker(self.distribute_strategy):
            # Keras 3.15 pulls a batch and `strategy.reduce`s it, which
            # fails under `MultiWorkerMirroredStrategy`
            # (keras-team/keras#20585); one replica's spec builds alike.
            spec = _keeper.replica_spec(_compat.data_spec_from_epoch_iterator(iterator))
            if spec is not None:
                spec = tree.map_structure(_keeper.none_for_none_spec, spec)
                with self.distribute_strategy.scope():
                    self._symbolic_build(data_batch=spec)
                return
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _make_function(self, step_function, *args, **kwargs):
        if _compat.BACKEND != "tensorflow":
            # The keeping step is made by `_keeper_jax.make_train_function`.
            return super()._make_function(step_function, *args, **kwargs)
        keeping = self._keep_gradients and step_function == self.train_step
        if _compat.collective_multi_worker(self.distribute_strategy):
            step_function = _keeper.with_batch_axis(step_function)
        if keeping and self._writes_sparse_after_xla():
            # Keras compiles its whole step function with XLA. Here XLA
            # compiles the step, and sparse slots (whose row count follows
            # the batch, which an XLA program cannot write) are written
            # after it, from the rows it returns.
            step_function = self._keeper.with_sparse_writes_after_xla(step_function)
            self._pending.xla_inside_step = True
            try:
                return super()._make_function(step_function)
            finally:
                self._pending.xla_inside_step = False
        return super()._make_function(step_function)

    def _new_keeper(self):
        """A keeper with no slots yet, set up for how the model trains."""
        if _compat.BACKEND == "torch":
            return _keeper.GradientKeeper(every=self._keep_every, name=self.name)
        if _compat.BACKEND != "tensorflow":
            return _keeper.GradientKeeper(every=self._keep_every)
        writes_after_xla = self._writes_sparse_after_xla()
        return _keeper.GradientKeeper(
            self.distribute_strategy,
            sparse=not self.jit_compile or writes_after_xla,
            every=self._keep_every,
            # Under XLA, a sparse gradient that the optimizer's update
            # densifies anyway (Adam's, for one) is kept dense inside the
            # compiled step, where XLA computes the dense tensor once for
            # both; writing the rows after the step would cost their copy
            # out of it. Only where the sum is shared: every step written
            # (with `keep_every > 1` the write sits in a conditional of its
            # own), and no strategy.
            choose_dense=(
                writes_after_xla and self._distribute_strategy is None and self._keep_every == 1
            ),
        )

    def _writes_sparse_after_xla(self):
        """Whether the step is compiled with XLA, sparse slots written after it."""
        if _compat.BACKEND != "tensorflow":
            return False
        return _keeper.writes_sparse_after_xla(
            self.jit_compile, self.run_eagerly, self._distribute_strategy
        )

    @property
    def jit_compile(self):
        """Bool. Whether the training step is compiled with XLA.

        Under a `tf.distribute` strategy with several replicas XLA cannot
        compile Keras's step (it reads each replica's variables from one
        device), so `True` falls back to `False` with a warning. On PyTorch,
        `True` compiles the step with `torch.compile`, the keeping outside
        it (see `_torch_compile`).
        """
        if getattr(getattr(self, "_pending", None), "xla_inside_step", False):
            return False  # only while `_make_function` wraps an XLA step
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        if (
            value
            and _compat.BACKEND == "tensorflow"
            and self.distribute_strategy.num_replicas_in_sync > 1
        ):
            warnings.warn(
                "`jit_compile=True` is not supported under a `tf.distribute` "
                "strategy with several replicas (Keras's own step fails: XLA "
                "cannot read the replicas' variables from one device). "
                "Proceeding with `jit_compile=False`. Received: "
                f"jit_compile={value!r} with "
                f"{type(self.distribute_strategy).__name__} of "
                f"{self.distribute_strategy.num_replicas_in_sync} replicas.",
                stacklevel=_user_stacklevel(),
            )
            value = False
        keras.Model.jit_compile.fset(self, value)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        if self._keep_gradients:
            metrics_lib._check_unique_keys(self)
            _capture.install()
            if _compat.BACKEND == "tensorflow":
                _keeper.install_reduction_reuse()
            # Fresh slots, made as the new training function is first
            # traced, from what its optimizers receive.
            self._keeper = self._new_keeper()
            metrics_lib.build_gradient_metrics(self)
            if _compat.BACKEND == "jax":
                return _keeper.make_train_function(self)
            if _compat.BACKEND == "torch":
                # `UpdateRatio` compares each update's before and after.
                self._keeper.record_updates = metrics_lib._measures_updates(self)
        return super().make_train_function(force=force)

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
            ValueError: `grads` and `variables` differ in length.

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
        grads, variables = list(grads), list(variables)
        step = _capture.current_step()
        if not self._keep_gradients:
            raise RuntimeError(
                f"Model {self.name!r} does not keep gradients, so "
                "`keep_step_gradients()` has nothing to keep them in. Build "
                "it with `keep_gradients=True`."
            )
        if step is None or step.model is not self:
            raise RuntimeError(
                "`keep_step_gradients()` keeps the gradients of a training "
                f"step of model {self.name!r}: call it from its `train_step` "
                "(run by `fit` or `train_on_batch`)."
            )
        if len(grads) != len(variables):
            raise ValueError(
                "`grads` and `variables` must have one entry per variable. "
                f"Received: {len(grads)} gradients for {len(variables)} "
                "variables."
            )
        return step.keeper.keep_given(step, variables, grads)

    # Under `torch.compile`, kept as in an eager step (`_torch_compile`).
    keep_step_gradients = _torch_compile.eager(keep_step_gradients)

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
            cls.train_step = _keeping(step)
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
            raise RuntimeError(_capture.nothing_kept_message(self))
        current = tuple(v.path for v in self.trainable_variables)
        if current != keeper.trainable_paths:
            added = sorted(set(current) - set(keeper.trainable_paths))
            removed = sorted(set(keeper.trainable_paths) - set(current))
            # On JAX the optimizer, built for the old variables, refuses a
            # rebuilt training function: only `compile` makes a new one.
            alternative = (
                "" if _compat.BACKEND == "jax" else ", or `model.make_train_function(force=True)`"
            )
            raise RuntimeError(
                "The kept gradients are stale: the trainable variables changed "
                "since the training function was built (now trainable: "
                f"{added}; no longer trainable: {removed}). Call "
                f"`model.compile(...)` again{alternative}, and train."
            )
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
        return _keeper.nest_by_path(self._checked_keeper().read())

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

    if _compat.BACKEND == "torch":

        def __getattr__(self, name):
            # Only reached when normal lookup fails. `torch.nn.Module`'s
            # `__getattr__` would replace the AttributeError that a property
            # of this class raised (`gradients` of a model that keeps none)
            # with "no attribute": raise the property's own again.
            if isinstance(vars(KeepGradModel).get(name), property):
                return object.__getattribute__(self, name)
            return super().__getattr__(name)


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


def _holds_saveable(value):
    """Whether Keras's saving would save state found in `value`."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_saveable(item) for item in value)
    return isinstance(value, _saving.KerasSaveable)


@keras.saving.register_keras_serializable(package="keras_keepgrad")
class WrappedKeepGradModel(KeepGradModel):
    """What `keep_gradients()` returns for a model that is not functional.

    It stands in for the wrapped model rather than adding a level above it,
    so that its variables and files look like that model's:

    - It opens no name scope of its own: a wrapped model built by the
      wrapper's first call names its kernel `"net/dense/kernel"`, as it
      would when called itself, not `"net/net/dense/kernel"`.
    - `layers` are the wrapped model's layers, and the wrapped model's
      attributes that the wrapper does not have are read through it: its
      public ones (except those Keras sets on any model as it compiles and
      trains it, such as `optimizer`) and private ones holding Keras
      saveables (`kept.dense is model.dense`, `kept.units`,
      `kept.encode(x)`). The wrapped model itself is kept under a private
      name, so an attribute `model` of its own reads through too.
    - Keras's saving walks a model's attributes (`dir(model)`) and saves
      each saveable under its attribute name, so it writes and reads the
      same groups for the wrapper as for the wrapped model (`dense/vars/0`,
      `vars/0` for the wrapped model's own variables, `optimizer/...`):
      weights files move between the two both ways. The wrapper adds only
      `_kept_gradients`, which it writes when `save_gradients=True`.
    """

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        if isinstance(model, dict):
            model = keras.saving.deserialize_keras_object(model)
        self._wrapped = model
        # Built with the wrapped model: it has no variables of its own, and
        # Keras's `save_weights`/`load_weights` refuse an unbuilt model.
        self.built = model.built

    def call(self, inputs, training=None):
        if self._wrapped._call_has_training_arg:
            return self._wrapped(inputs, training=training)
        return self._wrapped(inputs)

    def _open_name_scope(self):
        # Keras's `Layer.__call__` and `build` open the layer's name scope
        # around building and calling; the wrapped model opens its own.
        return contextlib.nullcontext()

    @property
    def layers(self):
        return self._wrapped.layers

    def _obj_type(self):
        # Keras's saving skips the attributes every object of this type has.
        return self._wrapped._obj_type()

    def save_own_variables(self, store):
        self._wrapped.save_own_variables(store)

    def load_own_variables(self, store):
        self._wrapped.load_own_variables(store)

    def _reads_through(self, name, value):
        """Whether the wrapped model's attribute `name` shows on the wrapper."""
        if name.startswith("__") or name in _compat.MODEL_STATE_ATTRIBUTES:
            return False
        return not name.startswith("_") or _holds_saveable(value)

    def __getattr__(self, name):
        # Only reached when normal lookup fails. A property of the wrapper
        # that raised AttributeError raises it again, with its own message.
        if hasattr(type(self), name):
            return object.__getattribute__(self, name)
        if _compat.BACKEND == "torch":
            # `torch.nn.Module` keeps submodules (the wrapped model among
            # them), parameters and buffers out of `__dict__`.
            try:
                return torch.nn.Module.__getattr__(self, name)
            except AttributeError:
                pass
        model = self._wrapped_model()
        if model is not None and not name.startswith("__"):
            try:
                value = getattr(model, name)
            except AttributeError:
                pass
            else:
                if self._reads_through(name, value):
                    return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _wrapped_model(self):
        """The wrapped model, or None while `__init__` has not set it."""
        model = self.__dict__.get("_wrapped")
        if model is None:
            # On PyTorch, `torch.nn.Module` holds it among its submodules.
            model = self.__dict__.get("_modules", {}).get("_wrapped")
        return model

    def __dir__(self):
        names = set(super().__dir__())
        model = self._wrapped_model()
        if model is None:
            return sorted(names)
        names.discard("_wrapped")  # saved as this model, not below it
        for name in dir(model):
            if name in names or name.startswith("__"):
                continue
            try:
                value = getattr(model, name)
            except Exception:
                continue
            if self._reads_through(name, value):
                names.add(name)
        return sorted(names)

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self._wrapped)
        return config


_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def _overridden_steps(cls):
    """The step methods that `cls` defines outside Keras and this package."""
    found = []
    for name in _STEP_METHODS:
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if not owner.__module__.startswith(("keras.", "keras_keepgrad.")):
            found.append(name)
    return found


def keep_gradients(model: keras.Model, **options: Any) -> "KeepGradModel":
    """Returns a `KeepGradModel` that trains `model`'s own variables.

    A functional or `Sequential` model (with an `Input`) becomes a functional
    `KeepGradModel` over the same layers; any other model is wrapped. Either
    way the variables are shared, so training the result trains `model`, and
    the kept gradients are keyed by the same variable paths. If `model` was
    compiled, the result is compiled with the same arguments and the same
    optimizer object (its state carries over).

    Args:
        model: A `keras.Model`: Sequential, functional or subclassed.
        **options: `keep_gradients`, `save_gradients` and `keep_every`, as
            for `KeepGradModel`.

    Returns:
        A `KeepGradModel`.

    Raises:
        TypeError: `model` is not a `keras.Model`, or an option is unknown
            or not a bool.
        ValueError: `keep_every` is not a positive int.

    Warns:
        UserWarning: `model`'s class overrides `train_step`, `test_step`,
            `predict_step`, `compute_loss` or `compute_metrics`, which the
            returned model does not run.

    Examples:
        >>> import keras, numpy as np
        >>> import keras_keepgrad as kg
        >>> plain = keras.Sequential([
        ...     keras.Input((1,)),
        ...     keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
        ...                        name="dense")], name="doc_seq")
        >>> model = kg.keep_gradients(plain)
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> history = model.fit(np.array([[1.0], [2.0]]), np.zeros((2, 1)),
        ...                     batch_size=2, verbose=0)
        >>> list(model.get_gradients_by_path())  # the original's variable paths
        ['doc_seq/dense/kernel']
        >>> model.gradients["doc_seq"]["dense"]["kernel"].numpy()
        array([[5.]], dtype=float32)
        >>> plain.get_weights()[0]  # the original model was trained
        array([[0.5]], dtype=float32)
    """
    _compat.check_backend("keep_gradients()")
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model` (Sequential, functional or "
            f"subclassed). Received: model={model!r} of type "
            f"{type(model).__name__}"
        )
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"keep_gradients() got unknown options {unknown}. Valid options: {list(_OPTIONS)}"
        )
    overridden = _overridden_steps(type(model))
    if overridden:
        warnings.warn(
            f"keep_gradients(): {type(model).__name__} overrides {overridden}, "
            "which the returned model does not run: it trains, evaluates and "
            "predicts with `KeepGradModel`'s own steps. Define them on a "
            "subclass of `kg.KeepGradModel` instead: a `train_step` of your "
            "own there keeps every gradient its optimizers receive.",
            stacklevel=2,
        )
    inputs = outputs = None
    if isinstance(model, (_compat.Functional, keras.Sequential)):
        inputs, outputs = _compat.functional_structure(model)
    # Under the strategy `model` was made in, as Keras's own models take it
    # from the scope they are made in: its variables are that strategy's.
    strategy = getattr(model, "_distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        if inputs is not None:
            kept = FunctionalKeepGradModel(inputs, outputs, name=model.name, **options)
        else:
            kept = WrappedKeepGradModel(model, name=model.name, **options)
        if model.compiled:
            config = _compat.compile_arguments(model)
            config["optimizer"] = model.optimizer
            kept.compile(**config)
    return kept


# Keras's legacy `.h5` format records a model's bare class name, and its
# loader looks that up among the global custom objects (not the
# package-qualified names registered above): so `load_model("m.h5")` finds
# these classes without `custom_objects`, as it finds Keras's own.
for _cls in (KeepGradModel, FunctionalKeepGradModel, WrappedKeepGradModel):
    keras.saving.get_custom_objects().setdefault(_cls.__name__, _cls)
del _cls
