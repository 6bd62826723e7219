"""Argument checks shared by the public classes, with Keras-style messages."""

import numbers

__all__ = ["check_bool", "check_keep_every"]


def check_bool(name, value):
    """Returns `value` if it is a bool; else a `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a bool (True or False). Received: "
            f"{name}={value!r} of type {type(value).__name__}"
        )
    return value


def check_keep_every(value):
    """Returns `value` as an int if it is a positive int; else a `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            "`keep_every` must be a positive int (1 keeps every step). "
            f"Received: keep_every={value!r}"
        )
    return int(value)
