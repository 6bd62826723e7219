"""Which training steps `skip_bad_steps` skipped, as the callbacks learn it.

A model built with `skip_bad_steps` logs `skipped_steps`, the count of
the epoch so far, with every training batch (with `steps_per_execution=N`,
once per execution, counting its N steps). The callbacks follow it batch
by batch (`SkippedLog`); `GradientTensorBoard` marks each batch whose
count went up with one scalar at its step, whatever `update_freq` says:
skipped steps are rare, and each is the one to find.
"""

import numpy as np

__all__ = ["LOG_KEY", "TAG", "SkippedLog", "mark"]

TAG = "gradients/bad_step_skipped"
LOG_KEY = "skipped_steps"


class SkippedLog:
    """Which recent training steps were skipped, from the batch logs.

    A batch (an execution) that ran steps `previous + 1 .. step` and whose
    count went up by as many skipped them all; up by none, none of them;
    up by fewer, some, which ones the log does not say.
    """

    def __init__(self):
        self._count = 0.0
        self.new = 0.0  # steps skipped in the last batch
        # `(previous, step, skipped)` of the batches that skipped steps and
        # were not forgotten yet; consecutive all-skipped ones merged.
        self._runs = []

    def begin_epoch(self):
        """The logged count starts again at each epoch."""
        self._count = 0.0

    def end_batch(self, logs, previous, step):
        """Takes the logs of the batch of steps `previous + 1 .. step`."""
        self.new = 0.0
        if not isinstance(logs, dict) or LOG_KEY not in logs:
            return
        count = float(np.asarray(logs[LOG_KEY]))
        self.new, self._count = count - self._count, count
        if self.new <= 0:
            return
        runs = self._runs
        if (
            self.new >= step - previous
            and runs
            and runs[-1][1] == previous
            and runs[-1][2] >= previous - runs[-1][0]
        ):
            runs[-1] = (runs[-1][0], step, step - runs[-1][0])
        else:
            runs.append((previous, step, self.new))

    def skipped(self, step):
        """True if training step `step` was skipped, False if it was not,
        None if its batch skipped some of its steps but not all."""
        for previous, last, skipped in self._runs:
            if previous < step <= last:
                return True if skipped >= last - previous else None
        return False

    def forget(self, step):
        """Drops what it knows of the steps up to `step`: they were read."""
        self._runs = [run for run in self._runs if run[1] > step]


def mark(writer, new, step):
    """Writes `TAG` = `new`, the steps skipped in the batch, at `step`."""
    import tensorflow as tf  # only where TensorBoard is written: not on import

    if new > 0:
        with writer.as_default(step=step), tf.summary.record_if(True):
            tf.summary.scalar(TAG, new)
