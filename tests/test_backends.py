"""The suite's JAX part, run from the TensorFlow run of the suite, and the
tutorials and demo on both backends.

`jax_backend/` holds the backend-neutral cases (the hand model's exact
gradients, every gradient metric, mixed precision, `keep_every`, saving,
distribution) as they run on Keras's JAX backend. One pytest process can
only have one Keras backend, so it runs in a subprocess with
`KERAS_BACKEND=jax` and two host CPU devices (for `DataParallel` and
`ModelParallel`).
"""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from conftest import python_env


@pytest.mark.slow
def test_the_jax_suite_passes():
    env = python_env(
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/jax_backend"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Every case ran: none skipped for want of the two devices.
    assert " passed" in result.stdout and "skipped" not in result.stdout


# The tutorials that make sense on JAX (not `distributed.py`: tf.distribute)
# and the demo. Their numbers come from NumPy-drawn weights and batches in
# order, so the two backends print the same ones.
SCRIPTS = {
    name: [os.path.join(REPO, "tutorials", f"{name}.py"), "--fast"]
    for name in (
        "quickstart",
        "mixed_precision",
        "saving",
        "custom_metric_and_callback",
        "diagnosing_gradients",
    )
}
SCRIPTS["demo"] = ["-m", "keras_keepgrad.demo", "--epochs", "1", "--quiet", "--logdir", "demo"]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# What differs between runs anyway: timings and the run's own paths.
_TIMING = re.compile(r"\d+(?:\.\d+)?(?:ms|us|s)(?:/step)?\b|Done in \S+ s")


def _run(script, backend, cwd):
    result = subprocess.run(
        [sys.executable, *SCRIPTS[script]],
        cwd=cwd,
        env=python_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (backend, result.stdout[-2000:] + result.stderr[-3000:])
    return _TIMING.sub("<time>", result.stdout.replace(str(cwd), "<dir>")).splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_same_numbers_on_tensorflow_and_jax(script, tmp_path):
    (tmp_path / "tf").mkdir()
    (tmp_path / "jax").mkdir()
    on_tf = _run(script, "tensorflow", tmp_path / "tf")
    on_jax = _run(script, "jax", tmp_path / "jax")
    assert len(on_tf) == len(on_jax) and on_tf, (on_tf, on_jax)
    compared = 0
    for tf_line, jax_line in zip(on_tf, on_jax):
        tf_line, jax_line = tf_line.replace("/tf", "/<b>"), jax_line.replace("/jax", "/<b>")
        assert _NUMBER.sub("#", tf_line) == _NUMBER.sub("#", jax_line), (tf_line, jax_line)
        for a, b in zip(_NUMBER.findall(tf_line), _NUMBER.findall(jax_line)):
            # Printed to 4 or 5 digits; full float reprs agree to float32
            # rounding (XLA and TensorFlow's kernels sum in other orders).
            assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-6), (tf_line, jax_line)
            compared += 1
    assert compared > 0
