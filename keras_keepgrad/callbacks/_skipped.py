"""`GradientTensorBoard`'s marks of the steps `skip_bad_steps` skipped.

A model built with `skip_bad_steps` logs `skipped_steps`, the count of
the epoch so far. Each training batch whose count went up is marked with
one scalar at its step, whatever `update_freq` says: skipped steps are
rare, and each is the one to find.
"""

import numpy as np

__all__ = ["TAG", "SkippedMarks"]

TAG = "gradients/bad_step_skipped"
_LOG_KEY = "skipped_steps"


class SkippedMarks:
    """Writes `TAG` = the number of steps skipped, at each step that did."""

    def __init__(self):
        self._count = 0.0

    def begin_epoch(self):
        """The logged count starts again at each epoch."""
        self._count = 0.0

    def write(self, writer, logs, step):
        """Marks `step` if `logs` count more skipped steps than before."""
        import tensorflow as tf

        if not isinstance(logs, dict) or _LOG_KEY not in logs:
            return
        count = float(np.asarray(logs[_LOG_KEY]))
        new, self._count = count - self._count, count
        if new > 0:
            with writer.as_default(step=step), tf.summary.record_if(True):
                tf.summary.scalar(TAG, new)
