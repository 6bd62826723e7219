"""The TensorFlow part of `KeepGradModel`: tracing, XLA and strategies."""

import os
import sys
import types
import warnings

import keras
import tensorflow as tf
from keras import tree

from keras_keepgrad import _capture
from keras_keepgrad import _compat
from keras_keepgrad.backend import base
from keras_keepgrad.backend.tensorflow import distribute
from keras_keepgrad.backend.tensorflow import keeper
from keras_keepgrad.backend.tensorflow import xla

__all__ = ["Trainer"]

# Keras's, TensorFlow's and this package's (three levels up from here).
_PACKAGE_FILE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (keras.__file__, os.path.join(_PACKAGE_FILE, "__init__.py"), tf.__file__)
)


def _user_stacklevel():
    """The `stacklevel` that makes a warning name the user's line.

    For `warnings.warn` in the calling function: it counts that function's
    frame as 1, then every frame of Keras, TensorFlow or this package
    above it (a setter reached through `compile` passes through several).
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class Trainer(base.Trainer):
    """`KeepGradModel` on TensorFlow: slots made as the step is traced."""

    def _init_backend_state(self):
        # True only while `_make_function` wraps an XLA step. Held in a
        # namespace: a value set on a Keras layer is seen by its tracker.
        self._pending = types.SimpleNamespace(xla_inside_step=False)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None and _compat.collective_multi_worker(self.distribute_strategy):
            # Keras 3.15 pulls a batch and `strategy.reduce`s it, which
            # fails under `MultiWorkerMirroredStrategy`
            # (keras-team/keras#20585); one replica's spec builds alike.
            spec = distribute.replica_spec(_compat.data_spec_from_epoch_iterator(iterator))
            if spec is not None:
                spec = tree.map_structure(distribute.none_for_none_spec, spec)
                with self.distribute_strategy.scope():
                    self._symbolic_build(data_batch=spec)
                return
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _make_function(self, step_function, *args, **kwargs):
        keeping = self._keep_gradients and step_function == self.train_step
        if _compat.collective_multi_worker(self.distribute_strategy):
            step_function = distribute.with_batch_axis(step_function)
        if keeping and self._writes_sparse_after_xla():
            # Keras compiles its whole step function with XLA. Here XLA
            # compiles the step, and sparse slots (whose row count follows
            # the batch, which an XLA program cannot write) are written
            # after it, from the rows it returns.
            step_function = self._keeper.with_sparse_writes_after_xla(step_function)
            self._pending.xla_inside_step = True
            try:
                return super()._make_function(step_function)
            finally:
                self._pending.xla_inside_step = False
        return super()._make_function(step_function)

    def _compiles_step_inside(self):
        return getattr(getattr(self, "_pending", None), "xla_inside_step", False)

    def _new_keeper(self):
        writes_after_xla = self._writes_sparse_after_xla()
        return keeper.GradientKeeper(
            self.distribute_strategy,
            sparse=not self.jit_compile or writes_after_xla,
            every=self._keep_every,
            # Under XLA, a sparse gradient that the optimizer's update
            # densifies anyway (Adam's, for one) is kept dense inside the
            # compiled step, where XLA computes the dense tensor once for
            # both; writing the rows after the step would cost their copy
            # out of it. Only where the sum is shared: every step written
            # (with `keep_every > 1` the write sits in a conditional of its
            # own), and no strategy.
            choose_dense=(
                writes_after_xla and _compat.model_strategy(self) is None and self._keep_every == 1
            ),
        )

    def _writes_sparse_after_xla(self):
        """Whether the step is compiled with XLA, sparse slots written after it."""
        return xla.writes_sparse_after_xla(
            self.jit_compile, self.run_eagerly, _compat.model_strategy(self)
        )

    def _make_keeping_train_function(self, force):
        distribute.install_reduction_reuse()
        super()._make_keeping_train_function(force)
        function = self.train_function
        if self.run_eagerly:
            return function

        # TensorFlow 2.21: a `tf.function` whose first trace made variables
        # (the slots are made as the step is traced) and then raised returns
        # None from every later call, tracing nothing. Until a call
        # succeeds, one that raises drops the function: the next `fit`
        # makes a new one.
        def first_calls(*args, **kwargs):
            try:
                result = function(*args, **kwargs)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise  # the data ended
            except BaseException:
                if self.train_function is first_calls:
                    self.train_function = None
                raise
            if self.train_function is first_calls:
                self.train_function = function
            return result

        self.train_function = first_calls
        return first_calls

    def _restores_state_on_error(self):
        # A traced step raises as it is traced, before anything runs; the
        # replicas' copies under a strategy are not put back.
        return tf.executing_eagerly() and not tf.distribute.has_strategy()

    def _strategy_refuses_skipping(self):
        strategy = self.distribute_strategy
        if strategy.num_replicas_in_sync == 1 or isinstance(
            strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
        ):
            return None
        return (
            "`skip_bad_steps` under a `tf.distribute` strategy with several "
            "replicas is supported with `MirroredStrategy` and "
            "`MultiWorkerMirroredStrategy` only. Received: "
            f"{type(strategy).__name__} of {strategy.num_replicas_in_sync} "
            f"replicas for model {self.name!r}. Use one of those, train "
            "on one replica, or set `model.skip_bad_steps = None`; "
            "`model.first_bad_replica` names the replica whose share of a "
            "batch went non-finite."
        )

    def _bad_devices(self, args, finite):
        # Under a strategy: each replica's own partial gradients, as noted
        # before the all-reduce (`replicas.BadReplicas`).
        del args, finite
        return self._keeper.bad_replicas.all_flags(_capture.current_step().backend_state)

    def _checked_jit_compile(self, value):
        if value and self.distribute_strategy.num_replicas_in_sync > 1:
            warnings.warn(
                "`jit_compile=True` is not supported under a `tf.distribute` "
                "strategy with several replicas (Keras's own step fails: XLA "
                "cannot read the replicas' variables from one device). "
                "Proceeding with `jit_compile=False`. Received: "
                f"jit_compile={value!r} with "
                f"{type(self.distribute_strategy).__name__} of "
                f"{self.distribute_strategy.num_replicas_in_sync} replicas.",
                stacklevel=_user_stacklevel(),
            )
            value = False
        return value
