"""Callbacks that read the kept gradients: TensorBoard panels, alarms, reports, files.

All four read the kept gradients between training steps (never inside
`train_step`: a `tf.summary` call traced into the step function would
freeze its step and `record_if` at trace time), so they need a model that
keeps gradients (`KeepGradModel` or `keep_gradients(model)`). For norms,
`GradientTensorBoard`, `GradientMonitor` and `GradientReport` read
statistics the training step computed once (each variable's sum of
squares, one small vector; they ask for it when Keras hands them the
model, before `fit` makes the training function), and the gradients
themselves only for histograms, snapshots, or where a value is not finite.

Vanishing and exploding: `VANISHING_THRESHOLD` (1e-5) and
`EXPLODING_THRESHOLD` (1e3), L2 gradient norms, are `GradientMonitor`'s
defaults, `GradientReport`'s verdicts and the marks on the color bar of
`GradientTensorBoard`'s heatmap.

Steps. A callback's step is the number of training batches run since `fit`
began. With `steps_per_execution=N` Keras calls back once per execution: the
callbacks see the gradients of the last of the N batches, and the step
advances by N. "Every k batches" means whenever the step passes a multiple
of k. Validation batches never change the kept gradients.

`keep_every=N`. The slots are then written on training steps 1, 1 + N, ...
only, and hold the last written step's gradients in between. Each callback
reads a written step once, at its first check after it, and labels it with
that step and with the epoch that step ran in (which may be an earlier one
than the epoch of the check): `GradientTensorBoard` writes the gradient
scalars (and heatmap column) at it (the optimizer's `loss_scale` and
`skipped_steps`, read at the check, at the current step),
`GradientSnapshot` names the file after it, `GradientMonitor` reports it.
A check that finds nothing new since the last one does nothing: with
`update_freq=1` and `keep_every=10`, scalars appear at steps 1, 11, 21, ...;
`vanishing_steps` counts the checks that read new gradients. Epoch
histograms show the epoch's last written step.

Skipped steps. With `skip_bad_steps`, the callbacks learn which steps were
skipped from the `skipped_steps` that `fit` logs with each batch:
`GradientTensorBoard` marks each batch that skipped one,
`GradientMonitor` reports a skipped step it reads as `"skipped"` (not as
non-finite or exploding), `GradientReport` counts them.

Layers. Per-layer values group variables by their path minus the last
component (`"dense_0/kernel"` and `"dense_0/bias"` make layer `"dense_0"`;
`"encoder/dense/kernel"` makes `"encoder/dense"`), in the order of
`model.trainable_variables`, which is forward order for Sequential and
functional models.
"""

from keras_keepgrad.callbacks._health import EXPLODING_THRESHOLD
from keras_keepgrad.callbacks._health import VANISHING_THRESHOLD
from keras_keepgrad.callbacks.monitor import GradientMonitor
from keras_keepgrad.callbacks.report import GradientReport
from keras_keepgrad.callbacks.snapshot import GradientSnapshot
from keras_keepgrad.callbacks.tensorboard import GradientTensorBoard

__all__ = [
    "EXPLODING_THRESHOLD",
    "VANISHING_THRESHOLD",
    "GradientMonitor",
    "GradientReport",
    "GradientSnapshot",
    "GradientTensorBoard",
]
