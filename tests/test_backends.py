"""The suite's JAX part, run from the TensorFlow run of the suite.

`jax_backend/` holds the backend-neutral cases (the hand model's exact
gradients, every gradient metric, mixed precision, `keep_every`, saving,
distribution) as they run on Keras's JAX backend. One pytest process can
only have one Keras backend, so it runs in a subprocess with
`KERAS_BACKEND=jax` and two host CPU devices (for `DataParallel` and
`ModelParallel`).
"""

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
