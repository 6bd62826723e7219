"""keras_keepgrad: see every batch's gradients during `model.fit`."""

from keras_keepgrad import callbacks
from keras_keepgrad import metrics
from keras_keepgrad._evidence import replay_batch
from keras_keepgrad._skipping import SkipBadSteps
from keras_keepgrad.model import KeepGradModel
from keras_keepgrad.wrapping import keep_gradients

__version__ = "0.1.0"

__all__ = [
    "KeepGradModel",
    "SkipBadSteps",
    "callbacks",
    "keep_gradients",
    "metrics",
    "replay_batch",
]
