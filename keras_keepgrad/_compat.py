"""The few private Keras pieces this package needs, in one place.

Tested with Keras 3.10 to 3.15 and TensorFlow 2.19 to 2.21 (TensorFlow, JAX
and PyTorch backends). Each helper names what it reaches for and why no
public API serves; where a name moved between those releases, the helper
has a branch per release.
"""

import importlib.metadata
import re
import sys
import warnings

import keras

# The oldest and newest (major, minor) releases the tests run on. Older ones
# lack private names this package reaches for; newer ones may have moved them.
TESTED_RANGES = {"Keras": ((3, 10), (3, 15)), "TensorFlow": ((2, 19), (2, 21))}


def minor_version(version):
    """`(major, minor)` of a version string such as "3.10.0" or "2.21.0rc1"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def tensorflow_version():
    """The installed TensorFlow's version, or None, without importing it.

    On JAX and PyTorch, TensorFlow only writes TensorBoard's event files and
    is imported when a callback does; its version is read from whichever of
    its wheels is installed.
    """
    tf = sys.modules.get("tensorflow")
    if getattr(tf, "__version__", None):
        return tf.__version__
    for distribution in ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _range_text(name):
    (low, high) = TESTED_RANGES[name]
    return f"{name} {low[0]}.{low[1]} to {high[0]}.{high[1]}"


def _pip_pin(name):
    (low, high) = TESTED_RANGES[name]
    package = "keras" if name == "Keras" else "tensorflow"
    return f"pip install '{package}>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'"


def check_versions(keras_version=None, tf_version=None):
    """Refuses a Keras or TensorFlow older than the tested range, warns on a newer one.

    Called as `keras_keepgrad` is imported, so that a release this package
    was not tested with is named then, not met as a missing private name in
    the middle of `fit`. An older release lacks names the helpers below
    reach for (ImportError); a newer one may still work (a warning).
    """
    versions = {
        "Keras": keras.__version__ if keras_version is None else keras_version,
        "TensorFlow": tensorflow_version() if tf_version is None else tf_version,
    }
    tested = f"{_range_text('Keras')} and {_range_text('TensorFlow')}"
    for name, version in versions.items():
        found = minor_version(version) if version else None
        if found is None:
            continue
        low, high = TESTED_RANGES[name]
        if found < low:
            raise ImportError(
                f"keras_keepgrad supports {tested}. Received: {name} {version}, "
                f"which lacks private {name} names it uses. Upgrade it: {_pip_pin(name)}"
            )
        if found > high:
            warnings.warn(
                f"keras_keepgrad is tested with {tested}. Received: {name} {version}, "
                f"newer than the tested range: a private {name} name it uses may have "
                f"moved and fail during training. To stay in the tested range: "
                f"{_pip_pin(name)}",
                stacklevel=2,
            )


def _import_error(e):
    """`e` (a private Keras or TensorFlow module that did not import), with the range."""
    return ImportError(
        f"keras_keepgrad supports {_range_text('Keras')} and {_range_text('TensorFlow')}; "
        f"with Keras {keras.__version__} and TensorFlow {tensorflow_version()} a private "
        f"name it uses is missing: {e}"
    )


check_versions()

try:
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    from keras.src.models.functional import Functional
    from keras.src.models.model import functional_init_arguments
    from keras.src.saving.keras_saveable import KerasSaveable
except ImportError as e:
    raise _import_error(e) from e

# The (major, minor) release of Keras, for the helpers whose names moved.
KERAS_VERSION = minor_version(keras.__version__)

# The Keras backends `KeepGradModel` keeps gradients on.
SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")

BACKEND = keras.backend.backend()


def check_backend(what):
    """Raises if Keras runs on a backend that keeping does not support.

    Gradients are kept where the optimizers of the TensorFlow, JAX and
    PyTorch trainers receive them; on any other backend a `KeepGradModel`
    would silently keep nothing.
    """
    backend = keras.backend.backend()
    if backend not in SUPPORTED_BACKENDS:
        raise RuntimeError(
            f"{what} requires the TensorFlow, the JAX or the PyTorch backend "
            f"of Keras. Received: KERAS_BACKEND={backend!r}. Set the "
            "environment variable KERAS_BACKEND=tensorflow, KERAS_BACKEND=jax "
            'or KERAS_BACKEND=torch (or `"backend": "jax"` in '
            "~/.keras/keras.json) before importing keras."
        )


# At import, before reaching for a trainer this backend does not have.
check_backend("keras_keepgrad")

try:
    if BACKEND == "tensorflow":
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
        from keras.src.backend.tensorflow.trainer import (
            _collective_all_reduce_multi_worker as collective_multi_worker,
        )

        # The trainer class `keras.Model` derives from on this backend.
        BackendTrainer = TensorFlowTrainer
        # The base class of the graphs of `tf.cond` branches and loop bodies
        # (TensorFlow's, private): the only way to tell that an op is traced
        # conditionally.
        from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
    elif BACKEND == "torch":
        from keras.src.backend.torch.trainer import TorchTrainer as BackendTrainer
    else:
        from keras.src.backend.jax.trainer import JAXTrainer as BackendTrainer
except ImportError as e:
    raise _import_error(e) from e

__all__ = [
    "BACKEND",
    "KERAS_VERSION",
    "TESTED_RANGES",
    "BackendTrainer",
    "ControlFlowFuncGraph",
    "Functional",
    "KerasSaveable",
    "MODEL_STATE_ATTRIBUTES",
    "SUPPORTED_BACKENDS",
    "callback_model",
    "check_backend",
    "check_versions",
    "compile_arguments",
    "compiled_metrics_as_passed",
    "collective_multi_worker",
    "data_spec_from_epoch_iterator",
    "functional_init_arguments",
    "follow_state_shardings",
    "functional_structure",
    "in_symbolic_build",
    "last_batch_of_execution",
    "make_function",
    "minor_version",
    "model_strategy",
    "optimizer_variables",
    "state_sharding_spec",
    "summary_ops",
    "tensor_version",
    "tensorflow_version",
    "torch_assign",
    "replace_metric_variable",
    "set_metric",
    "untrack_metric_variables",
]


# Attributes Keras 3.15 sets on a model only as it compiles (`optimizer`,
# `stop_training`), fits (`history`), evaluates or predicts, and then reads
# with `hasattr` / `getattr(..., default)`. A wrapper must not show its
# wrapped model's: they describe that model's own training, not the
# wrapper's. (The private ones, `_compile_config`, `_eval_epoch_iterator`, ...,
# are not read through anyway.)
MODEL_STATE_ATTRIBUTES = frozenset(
    ["optimizer", "stop_training", "history", "stop_evaluating", "stop_predicting"]
)


def functional_structure(model):
    """`(inputs, outputs)` of a functional or Sequential model, nested as built.

    `model.inputs` / `model.outputs` are flat lists: a model rebuilt from
    them would take and return lists where `model` takes one tensor or a
    dict (`predict` and a dict `loss` would change shape). Keras keeps the
    nesting only in the private `_inputs_struct` / `_outputs_struct` (of a
    Sequential model's `_functional`, made once its input shape is known:
    `(None, None)` before).
    """
    graph = model._functional if isinstance(model, keras.Sequential) else model
    if graph is None:
        return None, None
    return graph._inputs_struct, graph._outputs_struct


def compile_arguments(model):
    """The arguments `model.compile(...)` was called with, as given: Keras
    3.15 keeps them in `model._compile_config.config` (`get_compile_config()`
    serializes them, which would rebuild the optimizer and lose its state)."""
    return dict(model._compile_config.config)


def compiled_metrics_as_passed(model):
    """The `metrics` and `weighted_metrics` given to `compile`, unbuilt.

    Keras 3.15's `CompileMetrics` lists its metric objects only once it is
    built, in the first training step (without a strategy); until then it
    keeps them, as passed, in `_user_metrics` / `_user_weighted_metrics`.
    """
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return []
    return [
        getattr(compiled, "_user_metrics", None) or [],
        getattr(compiled, "_user_weighted_metrics", None) or [],
    ]


def data_spec_from_epoch_iterator(epoch_iterator):
    """The `tf.TypeSpec` structure of one batch of a `fit` epoch iterator.

    Keras 3.15's `TFEpochIterator` keeps the (possibly distributed) dataset
    in `_distributed_dataset`; its `element_spec` describes one batch
    without pulling data. Returns None where that is not available.
    """
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    return getattr(dataset, "element_spec", None)


def in_symbolic_build():
    """Whether Keras is tracing with symbolic tensors, not running a step:
    Keras 3.15's `Trainer._symbolic_build` calls `compute_metrics` once in a
    symbolic scope to create the metrics' state; no public API tells. (Not
    any stateless scope: Keras's JAX step runs the real metrics in one.)"""
    return in_symbolic_scope()


def untrack_metric_variables(metric, variables):
    """Removes `variables` from `metric.variables` (its state made anew).

    Keras 3.15's `Metric` tracks what `add_variable` made in its private
    `_variables` list and offers no way to remove one.
    """
    stale = {id(v) for v in variables}
    metric._variables[:] = [v for v in metric._variables if id(v) not in stale]


def model_strategy(model):
    """The `tf.distribute` strategy `model` was made under, or None.

    Keras 3.15 keeps it in the private `_distribute_strategy` (None when the
    model was made outside any strategy scope); the public
    `distribute_strategy` falls back to the default strategy, which cannot
    tell the two apart.
    """
    return getattr(model, "_distribute_strategy", None)


def tf_optimizer_class():
    """The base of Keras's TensorFlow optimizers, whose
    `_all_reduce_sum_gradients` sums the replicas' gradients in an update
    under a `tf.distribute` strategy (Keras 3.15); no public API exposes
    the sums."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def set_metric(layer, name, metric):
    """Sets `layer.<name>` to `metric` (or None), in place of the metric it held.

    Keras 3.15's `Layer.__delattr__` untracks variables only (a metric stays
    in the private `_tracker`'s store that `layer.metrics` lists), and it
    locks a subclassed model's `_tracker` once built (`quantize` unlocks it).
    """
    tracker = layer._tracker
    tracker.untrack(getattr(layer, name, None))  # None is in no store
    locked, tracker.locked = tracker.locked, False
    try:
        setattr(layer, name, metric)
    finally:
        tracker.locked = locked  # its message kept


def replace_metric_variable(metric, old, new):
    """Puts `new`, made by `metric.add_variable`, in `old`'s place.

    Keras 3.15 lists a metric's variables (`metric.variables`, in the order
    of the `stateless_*` methods' arguments and of saved files) in the
    store of its private `_tracker`, which `add_variable` appends to; no
    public API removes or replaces one.
    """
    metric._tracker.untrack(new)
    metric._tracker.replace_tracked_value("variables", old, new)


def optimizer_variables(optimizer):
    """The variables a built optimizer updates, in the order of its slots.

    Written against Keras 3.15: `optimizer.apply(grads)` without variables,
    and `stateless_apply`'s `trainable_variables` values, pair with the
    private `_trainable_variables` that `build` stored; no public attribute
    lists them (`optimizer.variables` are its own state). Before Keras 3.12
    a `LossScaleOptimizer`'s `build` stores none on itself, only on its
    inner optimizer, which its updates pass them to.
    """
    variables = getattr(optimizer, "_trainable_variables", None) or []
    if (
        not variables
        and KERAS_VERSION < (3, 12)
        and isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    ):
        variables = optimizer.inner_optimizer._trainable_variables
    return list(variables)


def state_sharding_spec(model):
    """The shardings of `model`'s training state under a JAX distribution.

    Keras 3.12 to 3.15: `JAXTrainer._get_state_sharding_spec`, which its
    `make_train_function` passes to `jax.jit` as the state's `out_shardings`;
    no public API gives them. Keras 3.10 and 3.11 have no such method: their
    `train_step` constrains the state to the shardings `fit` recorded
    (`_enforce_jax_state_sharding`), so the jitted step leaves them
    unspecified (None).
    """
    if KERAS_VERSION < (3, 12):
        return None
    return model._get_state_sharding_spec()


def make_function(model, step_function):
    """`model`'s training function around `step_function` (JAX).

    Written against Keras 3.15's `JAXTrainer._make_function`, which wraps a
    step for `steps_per_execution`, as its own `make_train_function` does;
    no public API takes a step function.
    """
    return model._make_function(step_function)


def callback_model(callback):
    """The model a Keras callback was set to, as `set_model` stored it.

    Written against Keras 3.15: `Callback.model` is a property that on JAX
    copies the training state into the model's variables
    (`jax_state_sync`) every time it is read, and on PyTorch unwraps a
    `DistributedDataParallel` wrapper; what `set_model` stored is
    `callback._model`, which Keras's own callbacks read in their per-batch
    hooks.
    """
    return callback._model


def tensor_version(tensor):
    """A torch tensor's version counter, which every in-place write increments.

    Written against Keras 3.15 on PyTorch 2: `tensor._version` is the only
    way to tell whether an optimizer's update wrote its gradient argument
    in place; torch has no public accessor.
    """
    return tensor._version


def torch_assign(variable, value, add=False):
    """`variable.assign(value)` (`assign_add` where `add`) on PyTorch, in
    place: Keras 3.15's converts and checks (~20 µs a write in a step, 2-core
    CPU), and its `assign_add` makes a new tensor then copies it. `_value` is
    the variable's own tensor (in a stateless scope it is not: Keras's run).
    """
    import torch

    if in_stateless_scope():
        return (variable.assign_add if add else variable.assign)(value)
    value = torch.as_tensor(value)
    if tuple(value.shape) != tuple(variable.shape):
        shapes = f"{tuple(variable.shape)}. Received: value.shape={tuple(value.shape)}"
        raise ValueError(f"A value written to {variable.path!r} must have its shape {shapes}")
    with torch.no_grad():
        (variable._value.add_ if add else variable._value.copy_)(value)


def summary_ops():
    """TensorFlow's generated summary ops, `write_raw_proto_summary` taking a writer handle.

    Written against Keras 3.15 and TensorFlow 2.21: `tf.summary` has no
    public op that writes into a writer resource passed as a tensor, which
    writing several rows in one traced function needs.
    """
    from tensorflow.python.ops import gen_summary_ops

    return gen_summary_ops


def last_batch_of_execution(batch, steps_per_execution):
    """The 0-based index, in the epoch, of the last batch of an execution.

    Keras 3.11 to 3.15 pass it to `on_train_batch_end`; Keras 3.10 passes
    the execution's first batch instead (its epoch iterator yields one
    index per execution), so with `steps_per_execution=N` the last one is
    N - 1 later (the caller clamps a partial last execution to the epoch).
    """
    if KERAS_VERSION < (3, 11):
        return batch + steps_per_execution - 1
    return batch


_STATE_SHARDINGS = (
    "_trainable_variable_shardings",
    "_non_trainable_variable_shardings",
    "_optimizer_variable_shardings",
    "_metrics_variable_shardings",
)


def follow_state_shardings(model, state):
    """Keras 3.10 and 3.11 (JAX): the recorded shardings cover all of `state`.

    Their `train_step` constrains each of the state's arrays to the sharding
    `fit` recorded for it before the first step (private attributes, one
    list per part of the state), by index. A gradient metric that makes its
    state once it knows the trainable variables adds metric variables after
    that, which have none recorded: a part whose count changed takes the
    shardings of `state`'s (concrete) arrays. Later releases pass the
    shardings to `jax.jit` instead (`state_sharding_spec`).
    """
    if KERAS_VERSION >= (3, 12):
        return
    for attribute, values in zip(_STATE_SHARDINGS, state):
        recorded = getattr(model, attribute, None)
        if recorded is not None and len(recorded) != len(values):
            setattr(model, attribute, [value.sharding for value in values])
