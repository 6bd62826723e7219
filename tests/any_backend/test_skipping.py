"""`skip_bad_steps` on JAX and PyTorch: the shared cases (`skipping_cases`)."""

import keras
import pytest
import skipping_cases as cases

assert keras.backend.backend() in ("jax", "torch"), "run with KERAS_BACKEND=jax or torch"

CASES = [
    cases.nan_step_leaves_the_state_bit_identical,
    cases.spike_above_the_factor_is_skipped_below_it_is_not,
    cases.history_counts_the_skipped_steps_per_epoch,
    cases.own_train_step_is_guarded,
    cases.off_changes_nothing,
    cases.under_loss_scaling,
    cases.flagged_counts_per_epoch_like_skipped,
    cases.monitor_reports_a_skipped_nan_step_as_skipped,
    cases.monitor_reports_a_skipped_spike_as_skipped_not_exploding,
    cases.monitor_reports_a_nan_the_skip_let_through_as_nonfinite,
    cases.monitor_knows_a_kept_step_skipped_before_its_check,
]

SAVING_CASES = [
    cases.nan_batch_is_saved_with_its_gradients,
    cases.spike_batch_is_saved_and_replays_to_its_gradients,
    cases.saved_files_stop_at_max_saved,
    cases.saving_adds_one_counter_and_off_adds_none,
    cases.saved_loss_scale_is_the_steps,
    cases.dict_inputs_are_saved_per_key_and_replayed,
    cases.flagged_steps_are_applied_counted_and_saved,
    cases.flagged_under_loss_scaling_is_skipped_by_the_optimizer,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_skipping(case, mode):
    case(mode)


@pytest.mark.parametrize("case", SAVING_CASES, ids=lambda c: c.__name__)
def test_saving_bad_batches(case, mode, tmp_path):
    case(mode, tmp_path)
