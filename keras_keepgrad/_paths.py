"""Variable paths and the layers they group into (a leaf: imports nothing)."""

__all__ = ["layer_of"]


def layer_of(path):
    """The layer a variable belongs to: its path minus the last component.

    `"dense_0/kernel"` -> `"dense_0"`, `"encoder/dense/bias"` ->
    `"encoder/dense"`. A path without `/` is its own group.
    """
    head, sep, _ = path.rpartition("/")
    return head if sep else path
