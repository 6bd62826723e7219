"""Argument checks shared by the public classes, with Keras-style messages."""

__all__ = ["check_bool"]


def check_bool(name, value):
    """Returns `value` if it is a bool; else a `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a bool (True or False). Received: "
            f"{name}={value!r} of type {type(value).__name__}"
        )
    return value
