"""Tests for keras_keepgrad.callbacks.report (GradientReport) and the
monitor's states; the cases are in `tests/report_cases.py`."""

import report_cases as cases


def test_report_values_by_hand(tmp_path, capsys):
    cases.report_values_by_hand(tmp_path, capsys)


def test_report_verdicts():
    cases.report_verdicts()


def test_monitor_defaults_catch_vanishing_and_exploding():
    cases.monitor_defaults_catch_vanishing_and_exploding()


def test_monitor_reports_a_state_once_with_its_end():
    cases.monitor_reports_a_state_once_with_its_end()


def test_monitor_summary_of_a_state_that_lasts_the_whole_run():
    cases.monitor_summary_of_a_state_that_lasts_the_whole_run()
