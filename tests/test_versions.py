"""The tested Keras and TensorFlow range, checked as `keras_keepgrad` is imported.

The check reads the versions, not the backend: the TensorFlow run covers it.
"""

import importlib
import warnings

import keras
import pytest

from keras_keepgrad import _compat

RANGE = "Keras 3.10 to 3.15 and TensorFlow 2.19 to 2.21"


def test_the_tested_range():
    assert _compat.TESTED_RANGES == {"Keras": ((3, 10), (3, 15)), "TensorFlow": ((2, 19), (2, 21))}


@pytest.mark.parametrize(
    "version, expected",
    [("3.10.0", (3, 10)), ("3.15.1", (3, 15)), ("2.21.0rc1", (2, 21)), ("3.16.0.dev2026", (3, 16))],
)
def test_minor_version(version, expected):
    assert _compat.minor_version(version) == expected


def test_unparsable_version_is_none():
    assert _compat.minor_version("nightly") is None


@pytest.mark.parametrize(
    "keras_version, tf_version",
    [("3.10.0", "2.19.0"), ("3.15.1", "2.21.0"), ("3.12.4", "2.20.0"), ("3.10.0", "")],
)
def test_a_tested_release_passes_silently(keras_version, tf_version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.check_versions(keras_version, tf_version) is None


@pytest.mark.parametrize(
    "keras_version, tf_version, found",
    [("3.9.2", "2.21.0", "Keras 3.9.2"), ("3.15.1", "2.18.1", "TensorFlow 2.18.1")],
)
def test_an_older_release_is_refused(keras_version, tf_version, found):
    with pytest.raises(ImportError) as info:
        _compat.check_versions(keras_version, tf_version)
    message = str(info.value)
    assert f"supports {RANGE}. Received: {found}," in message
    package = "keras>=3.10,<3.16" if found.startswith("Keras") else "tensorflow>=2.19,<2.22"
    assert message.endswith(f"Upgrade it: pip install '{package}'")


@pytest.mark.parametrize(
    "keras_version, tf_version, found",
    [("3.16.0", "2.21.0", "Keras 3.16.0"), ("3.10.0", "2.22.0", "TensorFlow 2.22.0")],
)
def test_a_newer_release_warns(keras_version, tf_version, found):
    with pytest.warns(UserWarning) as record:
        _compat.check_versions(keras_version, tf_version)
    assert len(record) == 1
    message = str(record[0].message)
    assert f"tested with {RANGE}. Received: {found}, newer than the tested range" in message


def test_importing_the_package_checks_the_version(monkeypatch):
    # What `import keras_keepgrad` runs, with the version it reads replaced.
    monkeypatch.setattr(keras, "__version__", "3.16.0")
    with pytest.warns(UserWarning, match=r"Received: Keras 3\.16\.0, newer"):
        importlib.reload(_compat)
    monkeypatch.setattr(keras, "__version__", "3.9.0")
    with pytest.raises(ImportError, match=r"supports Keras 3\.10 to 3\.15 .* Keras 3\.9\.0,"):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)
    assert _compat.KERAS_VERSION == _compat.minor_version(keras.__version__)
