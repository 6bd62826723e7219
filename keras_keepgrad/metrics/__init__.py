"""Gradient metrics: Keras metrics whose values come from the kept gradients.

Pass them to `compile(metrics=[...])` of a `KeepGradModel`, beside ordinary
metrics. They are updated inside the training step, on every step (also
each step under `steps_per_execution`), and `fit` reports them in the
progress bar, `logs`, `History`, `CSVLogger` and TensorBoard like any other
metric. They skip evaluation: they are absent from `evaluate()` results and
from the `val_` logs.

Each metric's `result()` is a dict of log entries: `{name: value}` (one
scalar), or one entry per layer (`{"grad_norm/dense": ..., ...}`) for the
per-layer metrics. Keras adds those keys to the logs as they are, so a
gradient metric logs under its own name wherever it is listed, also in a
per-output metrics dict (no output-name prefix: it measures the gradients
of the total loss, not of one output). The dict is empty while there is
nothing to report (no training step since the last reset).
"""

from keras_keepgrad.metrics.base import GradientMetric
from keras_keepgrad.metrics.compiled import build_gradient_metrics
from keras_keepgrad.metrics.cosine import GradientCosine
from keras_keepgrad.metrics.noise import GradientNoiseScale
from keras_keepgrad.metrics.noise import GradientSNR
from keras_keepgrad.metrics.norms import GradientMaxAbs
from keras_keepgrad.metrics.norms import GradientNorm
from keras_keepgrad.metrics.norms import NonFiniteGradients
from keras_keepgrad.metrics.norms import VanishingGradients
from keras_keepgrad.metrics.update_ratio import UpdateRatio

__all__ = [
    "GradientCosine",
    "GradientMaxAbs",
    "GradientMetric",
    "GradientNoiseScale",
    "GradientNorm",
    "GradientSNR",
    "NonFiniteGradients",
    "UpdateRatio",
    "VanishingGradients",
]
