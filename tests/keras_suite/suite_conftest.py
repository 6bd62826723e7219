"""conftest.py of a copied Keras test tree (`run.py` writes it there).

What Keras's own repository conftest gives its tests (`skip_if_backend`,
the markers), and a record of each test's outcome, written as JSON to
`$KERAS_SUITE_OUTCOMES` at the end of the session.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402
from keras.src.backend import backend  # noqa: E402

_OUTCOMES = {}
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: needs a backend that can train")
    config.addinivalue_line("markers", "multi_device: needs several devices")


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        # The first lines: an assertion's own line is often only its type.
        lines = [line.strip() for line in crash.message.splitlines() if line.strip()]
        return " | ".join(lines[:6])[:500]
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[-1])[:500]
    lines = str(report.longrepr).strip().splitlines()
    return lines[-1][:500] if lines else ""


def _record(nodeid, outcome, message, seconds=0.0):
    previous = _OUTCOMES.setdefault(
        nodeid, {"outcome": outcome, "message": message, "seconds": 0.0}
    )
    if _RANK[outcome] > _RANK[previous["outcome"]]:
        previous.update(outcome=outcome, message=message)
    previous["seconds"] = round(previous["seconds"] + seconds, 3)


def pytest_runtest_logreport(report):
    seconds = report.duration
    if report.passed:
        _record(report.nodeid, "passed", "", seconds)
    elif report.skipped:
        _record(report.nodeid, "skipped", _message(report), seconds)
    elif report.when == "call":
        _record(report.nodeid, "failed", _message(report), seconds)
    else:  # setup or teardown
        _record(report.nodeid, "error", f"{report.when}: {_message(report)}", seconds)


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid, "error", f"collection: {_message(report)}")


def pytest_sessionfinish(session):
    path = os.environ.get("KERAS_SUITE_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump(_OUTCOMES, f, indent=1, sort_keys=True)
