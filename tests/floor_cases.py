"""The dynamics benchmark's floors do the work they stand for, on every
backend: `tests/test_benchmark_floors.py` runs `check_floor`, one of the
modules every backend's run collects (`conftest.CONTRACT`).

The hand model (`conftest`): w = 3, x = [[1], [2]], y = 0, mse, SGD(0.1):
the gradients of three steps are 15, 7.5 and 3.75.
"""

import numpy as np
from conftest import fit_once
from conftest import load_benchmark
from conftest import one_weight

# `floor_window` adds every gradient into its buffer: 15 + 7.5 + 3.75, and
# its value is the step's sum of squares, averaged: (225 + 56.25 +
# 14.0625) / 3. `floor_dot` keeps the last gradient, and its value adds
# the dot product with the previous one: (225 + 0) + (56.25 + 7.5 * 15) +
# (14.0625 + 3.75 * 7.5) = 225 + 168.75 + 42.1875, averaged.
EXPECTED = {"floor_window": (26.25, 98.4375), "floor_dot": (3.75, 145.3125)}


def check_floor(kind):
    models = load_benchmark("models")
    (floor,) = models.gradient_metrics(kind)
    history = fit_once(one_weight(), batches=3, metrics=[floor])
    buffer, value = EXPECTED[kind]
    (held,) = floor._buffers.values()
    np.testing.assert_array_equal(np.asarray(held), [[buffer]])
    assert history.history[kind] == [value]
