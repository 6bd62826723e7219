"""The gradient metrics compiled into a model: found, built and checked.

What `KeepGradModel` asks of its gradient metrics as it makes its training
function (`build_gradient_metrics` and the checks before it), and what the
callbacks ask about them (`tensorboard_charts`).
"""

import contextlib
import re

import keras

from keras_keepgrad import _compat
from keras_keepgrad.metrics._backend import tf
from keras_keepgrad.metrics.base import GradientMetric
from keras_keepgrad.metrics.base import Holder
from keras_keepgrad.metrics.cosine import GradientCosine
from keras_keepgrad.metrics.noise import GradientNoiseScale
from keras_keepgrad.metrics.noise import GradientSNR
from keras_keepgrad.metrics.update_ratio import UpdateRatio

__all__ = [
    "build_gradient_metrics",
    "check_gradients_kept",
    "check_unique_keys",
    "gradient_metrics",
    "measures_updates",
    "tensorboard_charts",
    "untracked_state",
]


def gradient_metrics(model):
    """The gradient metrics compiled into `model`, each once, in order."""
    found = []
    # `CompileMetrics` holds the metrics passed to `compile`: once built in
    # its `metrics`, before that only as they were passed.
    passed = keras.tree.flatten(_compat.compiled_metrics_as_passed(model))
    for metric in [*model.metrics, *passed]:
        for m in [metric, *getattr(metric, "metrics", ())]:
            if isinstance(m, GradientMetric) and not any(m is f for f in found):
                found.append(m)
    return found


def measures_updates(model):
    """Whether one of `model`'s gradient metrics is an `UpdateRatio` (internal)."""
    return any(isinstance(m, UpdateRatio) for m in gradient_metrics(model))


def build_gradient_metrics(model):
    """Creates the state of `model`'s gradient metrics (internal).

    `KeepGradModel.make_train_function` calls it before the training step is
    traced, as Keras builds the optimizer: per-layer metrics learn their
    layers, and `UpdateRatio` copies the weights from before the first step
    (also under `run_eagerly=True`). Metrics built otherwise create their
    state in the first step.
    """
    metrics = gradient_metrics(model)
    if not metrics:
        return
    variables = list(model.trainable_variables)
    strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's only
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        for metric in metrics:
            metric._build_for(variables)


def check_gradients_kept(model):
    """Raises if `model` keeps no gradients but has gradient metrics (internal).

    Called by `make_train_function`, before the first step changes
    anything: the metrics would raise in that step, after its update on
    the backends that run it eagerly.
    """
    if model._keep_gradients:
        return
    metrics = gradient_metrics(model)
    if metrics:
        metric = metrics[0]
        raise ValueError(
            f"Gradient metric {metric.name!r} ({type(metric).__name__}) was "
            f"compiled into model {model.name!r}, which keeps no gradients: "
            "it measures the kept ones. Set `model.keep_gradients = True` "
            "before `fit` (a `KeepGradModel` keeps them by default), or "
            "compile without the metric. Received: keep_gradients=False"
        )


def untracked_state(model):
    """Copies the state that `model`'s gradient metrics hold outside Keras's
    tracking (`Holder`s); returns a function that puts it back (internal).

    What a step made there is dropped, to be made again by the next step.
    Only TensorFlow's metrics hold such state.
    """
    saved = []
    if _compat.BACKEND != "tensorflow":
        return lambda: None
    for metric in gradient_metrics(model):
        for holder in vars(metric).values():
            if isinstance(holder, Holder):
                contents = dict(holder.variables)
                variables = [v for v in keras.tree.flatten(contents) if isinstance(v, tf.Variable)]
                values = [tf.identity(v) for v in variables]
                saved.append((holder, contents, variables, values))

    def restore():
        for holder, contents, variables, values in saved:
            holder.variables.clear()
            holder.variables.update(contents)
            for variable, value in zip(variables, values):
                variable.assign(value)

    return restore


def _alike(a, b):
    """Whether two gradient metrics measure the same: one per output of a
    multi-output model logs one value, as they measure the total loss's
    gradients. The same `fn` object, not its serialized form (serializing
    a lambda warns)."""
    if type(a) is not type(b) or a.fn is not b.fn:
        return False
    if a.fn is not None:
        return a.reduction == b.reduction
    return a.get_config() == b.get_config()


def check_unique_keys(model):
    """Raises if two of `model`'s gradient metrics would log under one key (internal).

    Keras flattens each metric's `{key: value}` into the logs, where the
    later of two equal keys would silently replace the earlier. Called
    before `make_train_function` changes anything.
    """
    metrics = gradient_metrics(model)
    paths = [v.path for v in model.trainable_variables]
    owners = {}
    for metric in metrics:
        for key in metric._keys_for(paths) or ():
            other = owners.setdefault(key, metric)
            if other is not metric and not _alike(other, metric):
                raise ValueError(
                    "Two gradient metrics in `compile(metrics=...)` log under "
                    f"the same name {key!r}: "
                    f"{type(other).__name__}(name={other.name!r}) and "
                    f"{type(metric).__name__}(name={metric.name!r}), so one "
                    "would hide the other in the logs and History. Give "
                    f"each its own `name=...`, e.g. {type(metric).__name__}"
                    f"(..., name={metric.name + '_2'!r})."
                )


def tensorboard_charts(model):
    """`[(title, [tag regex, ...])]`: custom-scalars charts of the dynamics
    metrics compiled into `model`, for the logs Keras's TensorBoard writes
    (`epoch_<key>`, and `batch_<key>` with a batch `update_freq`)."""
    charts = []
    for metric in gradient_metrics(model):
        name = re.escape(metric.name)
        if isinstance(metric, GradientNoiseScale):
            charts.append(("Gradient noise scale (B_simple)", [f"^(epoch|batch)_{name}$"]))
            if metric.components:
                charts.append(
                    (
                        "Gradient noise scale: tr(Sigma) and |G|^2",
                        [f"^(epoch|batch)_{name}/(trace_cov|grad_sq)$"],
                    )
                )
        elif isinstance(metric, GradientSNR):
            charts.append(("Gradient signal-to-noise ratio", [f"^(epoch|batch)_{name}(/.*)?$"]))
        elif isinstance(metric, GradientCosine):
            charts.append(("Cosine of successive gradients", [f"^(epoch|batch)_{name}(/.*)?$"]))
    return charts
