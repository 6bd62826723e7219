"""The keeping mechanism of the running Keras backend, picked once.

The keeping's one choice of backend: the rest of the package keeps through
the names below, which are the running backend's. (Elsewhere the backend is
tested only for a per-backend fast path or a TensorFlow-only feature: in
`metrics/`, `_squares.py`, `_capture.py`, `_compat.py`, `_ops.py` and
`_torch_compile.py`; `model.py` and `wrapping.py` never test it.)

- `GradientKeeper`: the backend's `base.Keeper`.
- `Trainer`: the backend's `base.Trainer`, a base of `KeepGradModel`.
- `apply_if`: runs an optimizer's `apply` only where a step is not
  skipped, and `global_gradients`: what a step is judged by, the same on
  every replica of a `tf.distribute` strategy (`_skipping`); `call_if`: a
  host call where a step was skipped, and `replay_gradients`: a saved
  batch's gradients again (`_evidence`).
- `densify`, `unscale`, `current_step_gradients`: reading the gradients
  of the training step being run or traced (`current_step_variables`,
  `current_step_updates` and `reduces_in_step` where the backend has them).
- `evaluation_step`, `in_evaluation_step`, `nest_by_path`: from `_capture`.
"""

from keras_keepgrad import _compat
from keras_keepgrad._capture import evaluation_step
from keras_keepgrad._capture import in_evaluation_step
from keras_keepgrad._capture import nest_by_path

if _compat.BACKEND == "jax":
    from keras_keepgrad.backend.base import global_gradients
    from keras_keepgrad.backend.jax import GradientKeeper
    from keras_keepgrad.backend.jax import Trainer
    from keras_keepgrad.backend.jax import apply_if
    from keras_keepgrad.backend.jax import call_if
    from keras_keepgrad.backend.jax import current_step_gradients
    from keras_keepgrad.backend.jax import current_step_updates
    from keras_keepgrad.backend.jax import current_step_variables
    from keras_keepgrad.backend.jax import densify
    from keras_keepgrad.backend.jax import replay_gradients
    from keras_keepgrad.backend.jax import unscale
elif _compat.BACKEND == "torch":
    from keras_keepgrad.backend.base import global_gradients
    from keras_keepgrad.backend.torch import GradientKeeper
    from keras_keepgrad.backend.torch import Trainer
    from keras_keepgrad.backend.torch import apply_if
    from keras_keepgrad.backend.torch import call_if
    from keras_keepgrad.backend.torch import current_step_gradients
    from keras_keepgrad.backend.torch import current_step_updates
    from keras_keepgrad.backend.torch import densify
    from keras_keepgrad.backend.torch import replay_gradients
    from keras_keepgrad.backend.torch import unscale
else:
    from keras_keepgrad.backend.tensorflow.distribute import global_gradients
    from keras_keepgrad.backend.tensorflow.distribute import reduces_in_step
    from keras_keepgrad.backend.tensorflow.keeper import GradientKeeper
    from keras_keepgrad.backend.tensorflow.keeper import current_step_gradients
    from keras_keepgrad.backend.tensorflow.keeper import current_step_variables
    from keras_keepgrad.backend.tensorflow.keeper import densify
    from keras_keepgrad.backend.tensorflow.keeper import unscale
    from keras_keepgrad.backend.tensorflow.skipping import apply_if
    from keras_keepgrad.backend.tensorflow.skipping import call_if
    from keras_keepgrad.backend.tensorflow.skipping import replay_gradients
    from keras_keepgrad.backend.tensorflow.trainer import Trainer

# Optimizer methods that hand gradients to the keeper: on JAX a step's
# optimizers update through `stateless_apply`; elsewhere it calls `apply`.
CAPTURED_METHODS = ("apply", "stateless_apply") if _compat.BACKEND == "jax" else ("apply",)
