"""Which gradients the optimizers receive in a training step.

Backend-neutral. While a `KeepGradModel`'s training step runs (or is
traced), `training_step` makes it the current step of this thread, and
every optimizer's `apply` (which `apply_gradients` calls) hands its
gradients to the step's keeper before it proceeds exactly as Keras would.
So whoever wrote the step, Keras or the user, and however many optimizers
it uses, the gradients each one receives are kept. Outside such a step the
wrapped `apply` is Keras's own.

On JAX, where a step is a pure function of its state, optimizers update
through `stateless_apply`, which is wrapped the same way.

An optimizer that calls another's `apply` (a `LossScaleOptimizer` calling
its inner optimizer, `stateless_apply` calling `apply`) is captured once,
at the outermost call: what the user's step handed over. Where the model
skips bad steps, the step's `guard` (`_skipping`) decides if it runs.
"""

import contextlib
import functools
import threading
import warnings

import keras
import numpy as np
from keras import ops

from keras_keepgrad import _checks
from keras_keepgrad import _compat
from keras_keepgrad import _torch_compile

__all__ = [
    "Step",
    "build_as_apply",
    "current_step",
    "do_not_convert",
    "evaluation_step",
    "finish_step",
    "in_evaluation_step",
    "install",
    "nest_by_path",
    "training_step",
    "unscale",
]

_local = threading.local()

# Training steps open on any thread. On PyTorch, `torch.compile` reads it
# (as a guarded constant) where the thread-local step would be a new object
# every step: see `_capturing`.
_open_steps = 0
_open_steps_lock = threading.Lock()


class Step:
    """One training step's kept gradients, as the optimizers receive them.

    Args:
        model: The `KeepGradModel` whose step this is.
        keeper: The backend's keeper: `keep_from_optimizer` stores one
            `apply`'s gradients, `begin_step` / `end_step` bracket the
            step.

    Attributes:
        grads: `{variable path: kept gradient}` of the `apply` calls so
            far in this step, in call order.
        variables: `{variable path: variable}`, likewise.
        reduced: Whether `grads` are already the global-batch gradients
            (always, but on some replicas of a `tf.distribute` strategy).

    Raises:
        ValueError: Two of the model's trainable variables share a path.
    """

    def __init__(self, model, keeper):
        self.model = model
        self.keeper = keeper
        self.grads = {}
        self.variables = {}
        self.reduced = True
        self.applying = False
        self.backend_state = None
        # The `_skipping.Guard` that judges its updates, if the model skips bad steps.
        self.guard = None
        self._updating = False
        # `{path: variable}` of the model's trainable variables and of all
        # that the step handed over so far: checked before anything changes.
        self._owners = {}
        self.claim(model.trainable_variables)
        # `{id: (variable, value before the step)}` of what the step's
        # updates so far could change (`remember`, which also asks whether
        # the update runs as it is called); None where nothing can raise
        # after an update ran (`claim`, skipping's judgement: `put_back`).
        self._before = None
        if not keeper.ran_a_step and getattr(type(model).train_step, "_own_step", False):
            self._before = {}

    @property
    def expects_gradients(self):
        """Whether the model has trainable variables, so that a step with
        nothing kept is a mistake rather than a model with nothing to train.

        Read when asked, not as the step begins: a model built by its first
        batch has no variables before that batch's forward pass.
        """
        return bool(self.model.trainable_variables)

    def before_update(self):
        """Called before each update the step keeps; the first one lets the
        model finish what needed its variables (`_before_first_update`).

        By then the forward pass has built the model, and nothing was
        updated yet.
        """
        if not self._updating:
            self._updating = True
            self.model._before_first_update()

    def claim(self, variables):
        """Raises if one of `variables` shares its path with another variable
        of the model or of the step; call it before they are updated.

        In a step that runs as it is called, the updates before it have
        run by then: they are put back first (`remember`).
        """
        try:
            _checks.check_unique_paths(self.model, variables, self._owners)
        except ValueError:
            self.put_back()
            raise

    def put_back(self):
        """Puts back what the step's updates so far changed, where they ran
        as they were called (`remember`): call it before raising."""
        for variable, value in (self._before or {}).values():
            variable.assign(value)

    def remember(self, optimizer, variables):
        """Copies what `optimizer`'s update of `variables` can change, so
        that a later `claim` that raises can put it back (`put_back`).

        Only in the first step of a model whose own `train_step` runs as
        it is called (eager PyTorch and TensorFlow), where an optimizer
        whose paths collide with another's is found at its own `apply`,
        after the other's ran (so is a second `apply` that skipping with a
        `spike_factor` refuses); not where the `apply` is traced (a
        `tf.function` inside an eager step), which raises as it is traced.
        Later steps are not copied (each step would pay for it). The
        copies are NumPy arrays in host memory, held for the step only, so
        that a model that fills its accelerator does not run out of
        memory for them.
        """
        if self._before is None or not self.model._restores_state_on_error():
            return
        build_as_apply(optimizer, variables)  # so that its state has values
        for variable in [*variables, *optimizer.variables]:
            if id(variable) not in self._before:
                value = np.array(ops.convert_to_numpy(variable.value), copy=True)
                self._before[id(variable)] = (variable, value)

    def add(self, variables, grads, reduced):
        """Records one `apply`'s kept gradients."""
        for variable, grad in zip(variables, grads):
            self.grads[variable.path] = grad
            self.variables[variable.path] = variable
        self.reduced = self.reduced and reduced


def build_as_apply(optimizer, variables):
    """Builds `optimizer` for `variables` as its `apply` would, if unbuilt.

    For what must see the optimizer's state before its `apply` runs: the
    state exists only once it is built, and some places (a `tf.cond`
    branch) cannot create it.
    """
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)


def unscale(optimizer, variables, grads, map_values=None):
    """What the optimizer's update receives, from the scaled gradients.

    Mirrors Keras 3.15 on every backend: a `LossScaleOptimizer` divides each
    gradient by its dynamic scale with `ops.divide` (so float16 gradients
    become float32), any other optimizer by its static `loss_scale_factor`.
    Variables with `overwrite_with_gradient` (FP8 scales) are assigned the
    raw value by the optimizer, unscaled, and so are kept raw. A variable
    the loss does not reach gets zeros of its dtype that pass through the
    same division, so its dtype matches that of its neighbours.

    The dynamic scale is read here, before `optimizer.apply` may double or
    halve it (on JAX, as the enclosing `StatelessScope` maps it).

    Args:
        optimizer: The optimizer receiving `grads`, or None.
        variables: The variables they are gradients of.
        grads: The gradients (None where the loss does not reach).
        map_values: `map_values(grad, fn)` applies the division to a
            gradient; for gradients that are not plain tensors (TensorFlow's
            `tf.IndexedSlices`). Defaults to `fn(grad)`.
    """
    divide = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
        scale = ops.convert_to_tensor(scale, dtype="float32")

        def divide(t):
            return ops.divide(t, scale)

    elif optimizer is not None and optimizer.loss_scale_factor is not None:
        factor = optimizer.loss_scale_factor

        def divide(t):
            return t / factor

    unscaled = []
    for variable, grad in zip(variables, grads):
        if grad is None:
            grad = ops.zeros(variable.shape, dtype=variable.dtype)
        if divide is not None and not getattr(variable, "overwrite_with_gradient", False):
            grad = divide(grad) if map_values is None else map_values(grad, divide)
        unscaled.append(grad)
    return unscaled


def finish_step(keeper, step, update="optimizer.apply"):
    """The end-of-step bookkeeping every keeper shares; returns the kept paths.

    Sets `keeper.paths` to the paths the step kept, in
    `model.trainable_variables` order (then any others, in call order), and
    `keeper.trainable_paths` to the model's trainable paths. Warns once per
    keeper (`keeper._warned_missing`) if the step kept some gradients but
    not those of every trainable variable.

    Args:
        keeper: The backend's keeper.
        step: The `Step` that ends.
        update: The call to name in the warning: how that backend's
            steps hand gradients to an optimizer.
    """
    trainable = [v.path for v in step.model.trainable_variables]
    order = {path: i for i, path in enumerate(trainable)}
    kept = sorted(step.grads, key=lambda p: order.get(p, len(order)))
    missing = [p for p in trainable if p not in step.grads]
    if kept and missing and not keeper._warned_missing:
        keeper._warned_missing = True
        warnings.warn(
            f"The training step of model {step.model.name!r} passed no "
            f"gradient for the trainable variables {missing} to any "
            "optimizer, so they have no kept gradient and are absent "
            f"from `model.gradients`. Pass them to `{update}` (a None "
            "gradient is kept as zeros), or make them non-trainable.",
            stacklevel=3,
        )
    keeper.paths = tuple(kept)
    keeper.trainable_paths = tuple(trainable)
    return kept


def nest_by_path(flat):
    """`{"a/b/c": x}` -> `{"a": {"b": {"c": x}}}`, as `get_state_tree()` nests."""
    nested = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


_evaluation = threading.local()


@contextlib.contextmanager
def evaluation_step():
    """Marks a test step: gradient metrics skip it instead of failing."""
    previous = getattr(_evaluation, "active", False)
    _evaluation.active = True
    try:
        yield
    finally:
        _evaluation.active = previous


def in_evaluation_step():
    """Whether a `KeepGradModel` test step is being traced or run."""
    return getattr(_evaluation, "active", False)


def current_step():
    """The `Step` being run or traced on this thread, else None."""
    return getattr(_local, "step", None)


@contextlib.contextmanager
def training_step(model, keeper):
    """Runs the block as `model`'s training step; yields the `Step`."""
    global _open_steps
    step = Step(model, keeper)
    previous = current_step()
    _local.step = step
    with _open_steps_lock:
        _open_steps += 1
    try:
        keeper.begin_step(step)
        yield step
        keeper.end_step(step)
        keeper.ran_a_step = True
    finally:
        _local.step = previous
        with _open_steps_lock:
            _open_steps -= 1


def do_not_convert(fn):
    """`fn`, marked for TensorFlow's AutoGraph (if that is the backend)."""
    if keras.backend.backend() != "tensorflow":
        return fn
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(fn)


def _capturing(apply):
    """`apply` of an optimizer class, wrapped to hand gradients over first."""

    @functools.wraps(apply)
    def capturing_apply(optimizer, grads, trainable_variables=None):
        # Called from a user's step, which a `tf.function` may convert with
        # AutoGraph: this runs as written, as Keras's own `apply` does in
        # `fit`.
        step = current_step()
        if step is None or step.applying:
            return apply(optimizer, grads, trainable_variables)
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        elif optimizer.built:
            variables = _compat.optimizer_variables(optimizer)
        else:
            # Keras raises its own error for this.
            return apply(optimizer, grads, trainable_variables)
        if not grads:
            return apply(optimizer, grads, trainable_variables)
        step.claim(variables)
        step.remember(optimizer, variables)
        step.before_update()

        def run(grads, kept):
            step.applying = True
            update = functools.partial(apply, optimizer, grads, trainable_variables)
            try:
                if step.guard is None:
                    return update()
                return step.guard.apply(optimizer, variables, kept, grads, update)
            finally:
                step.applying = False

        return step.keeper.keep_from_optimizer(step, optimizer, variables, grads, run)

    if keras.backend.backend() == "torch":
        capturing_apply = _outside_torch_compile(apply, capturing_apply)
    capturing_apply._keepgrad_original = apply
    return do_not_convert(capturing_apply)


def _outside_torch_compile(apply, capturing_apply):
    """`capturing_apply`, run outside what `torch.compile` traces.

    Inside a compiled training step the capture and the update it wraps
    run eagerly (`_torch_compile.eager`), exactly as in an eager step: the
    keeper reads each gradient's version counter and copies it around the
    update that really runs. Where no training step is open (a plain
    model's), `apply` is Keras's own, compiled as Keras compiles it.
    """
    eager = _torch_compile.eager(capturing_apply)

    @functools.wraps(apply)
    def capturing_apply_torch(optimizer, grads, trainable_variables=None):
        if _open_steps:
            return eager(optimizer, grads, trainable_variables)
        return apply(optimizer, grads, trainable_variables)

    return capturing_apply_torch


def _capturing_stateless(stateless_apply):
    """`stateless_apply` of an optimizer class, wrapped likewise (JAX)."""

    @functools.wraps(stateless_apply)
    def capturing_stateless_apply(optimizer, optimizer_variables, grads, trainable_variables):
        step = current_step()
        if step is None or step.applying or not optimizer.built or not grads:
            return stateless_apply(optimizer, optimizer_variables, grads, trainable_variables)
        grads, values = list(grads), list(trainable_variables)
        step.claim(_compat.optimizer_variables(optimizer))
        step.before_update()

        def run(grads, kept):
            step.applying = True
            try:
                if step.guard is None:
                    return stateless_apply(optimizer, optimizer_variables, grads, values)
                return step.guard.apply_stateless(
                    optimizer,
                    kept,
                    lambda: stateless_apply(optimizer, optimizer_variables, grads, values),
                    (values, list(optimizer_variables)),
                )
            finally:
                step.applying = False

        return step.keeper.keep_from_stateless(
            step, optimizer, optimizer_variables, grads, values, run
        )

    capturing_stateless_apply._keepgrad_original = stateless_apply
    return capturing_stateless_apply


_install_lock = threading.Lock()
_installed = False


def install(again=True, methods=("apply",)):
    """Wraps `methods` of every optimizer class defined so far (idempotent).

    `apply` everywhere; on JAX also `stateless_apply`, through which its
    steps update (elsewhere `stateless_apply` calls `apply`, which is
    captured). Called whenever a `KeepGradModel` builds its training
    function, so that optimizer classes defined after an earlier call (a
    user's own, overriding `apply`) are wrapped too. With `again=False`,
    only if it was never called.
    """
    global _installed
    if _installed and not again:
        return
    with _install_lock:
        _installed = True
        wrappers = {name: _WRAPPERS[name] for name in methods}
        # Every optimizer class derives from the one defining `apply`.
        pending = [next(c for c in keras.optimizers.Optimizer.__mro__ if "apply" in vars(c))]
        seen = set()
        while pending:
            cls = pending.pop()
            if cls in seen:
                continue
            seen.add(cls)
            pending.extend(cls.__subclasses__())
            for name, wrap in wrappers.items():
                method = vars(cls).get(name)
                if method is not None and not hasattr(method, "_keepgrad_original"):
                    setattr(cls, name, wrap(method))


_WRAPPERS = {"apply": _capturing, "stateless_apply": _capturing_stateless}
