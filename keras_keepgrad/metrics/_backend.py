"""What the metrics compute with, on the running backend.

`tf` is TensorFlow on TensorFlow, and on JAX and PyTorch `_ops.tf_ops`: the
same functions in `keras.ops`, so that the metrics' arithmetic is written
once for every backend and TensorFlow is not imported off it. `keeper` is
the backend's keeper module: the kept gradients, variables and updates of
the step being run.
"""

from keras_keepgrad import _compat

if _compat.BACKEND == "tensorflow":
    import tensorflow as tf

    from keras_keepgrad.backend.tensorflow import keeper
elif _compat.BACKEND == "jax":
    from keras_keepgrad._ops import tf_ops as tf
    from keras_keepgrad.backend import jax as keeper
else:
    from keras_keepgrad._ops import tf_ops as tf
    from keras_keepgrad.backend import torch as keeper

__all__ = ["keeper", "tf"]
