import contextlib
import os
import socket

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The one-weight model of the tests: a bias-free Dense(1) with w = 3,
# x = [[1], [2]], y = 0, mse. loss = mean((w*x)^2) -> d/dw = w*(1+4) = 5w = 15,
# and with SGD(0.1) the new weight is 3 - 0.1*15 = 1.5.
X = np.array([[1.0], [2.0]], dtype="float32")
Y = np.zeros((2, 1), dtype="float32")
W0 = 3.0

MODES = {
    "eager": dict(run_eagerly=True),
    "graph": dict(jit_compile=False),
    "jit": dict(jit_compile=True),
}


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(params=list(MODES))
def mode(request):
    return MODES[request.param]


def dense_0(dtype=None, name="dense_0", w=W0):
    return keras.layers.Dense(
        1,
        use_bias=False,
        kernel_initializer=keras.initializers.Constant(w),
        name=name,
        dtype=dtype,
    )


def free_ports(n):
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
