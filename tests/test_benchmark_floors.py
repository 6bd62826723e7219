"""The dynamics benchmark's floors do the work they stand for, on every
backend (see `floor_cases`)."""

import floor_cases
import pytest


@pytest.mark.parametrize("kind", ["floor_window", "floor_dot"])
def test_the_floors_do_their_work(kind):
    floor_cases.check_floor(kind)
