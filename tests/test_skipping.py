"""`skip_bad_steps` on TensorFlow: the shared cases (`skipping_cases`), in
eager, graph and XLA steps, and what is TensorFlow's or backend-free
(arguments, saving, TensorBoard, strategies)."""

import keras
import numpy as np
import pytest
import skipping_cases as cases
import tensorflow as tf
from conftest import X
from conftest import Y
from conftest import one_weight

import keras_keepgrad as kg
from keras_keepgrad.callbacks import _skipped

CASES = [
    cases.nan_step_leaves_the_state_bit_identical,
    cases.spike_above_the_factor_is_skipped_below_it_is_not,
    cases.history_counts_the_skipped_steps_per_epoch,
    cases.own_train_step_is_guarded,
    cases.off_changes_nothing,
    cases.under_loss_scaling,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_skipping(case, mode):
    case(mode)
