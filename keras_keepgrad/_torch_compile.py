"""What runs outside `torch.compile` in a keeping step on PyTorch.

With `jit_compile=True` Keras's PyTorch trainer hands its step function to
`torch.compile`, whose tracer (Dynamo) turns the Python it traces into
compiled graphs and replays that Python's side effects. The keeping is
Python state that must happen as written, on every step: the current step
(a thread-local object, new each step), the keeper's step count and
slots, each gradient's version counter read around the update, and the
gradient metrics' reads of the step's kept gradients. Traced, those would
be guarded constants of the step that was traced. So they run outside what
Dynamo compiles, eagerly, as in an eager step; the step's own computation
between them (the forward pass, the loss, Keras's metrics) stays compiled.
Each such call splits the compiled step there (a graph break).

On the other backends these helpers change nothing. Written against
PyTorch 2.13's `torch.compiler.disable`.
"""

import keras

__all__ = ["eager", "eager_context", "eager_frame"]


def _on_torch():
    return keras.backend.backend() == "torch"


def eager(fn):
    """`fn`, and everything it calls, run outside `torch.compile`."""
    if not _on_torch():
        return fn
    import torch

    return torch.compiler.disable(fn)


def eager_frame(fn):
    """`fn`'s own frame run outside `torch.compile`; what it calls is
    compiled as a step of its own (a user's `train_step` inside the
    keeping around it)."""
    if not _on_torch():
        return fn
    import torch

    return torch.compiler.disable(fn, recursive=False)


class _EagerContext:
    """Makes, enters and exits `make(*args)` outside `torch.compile`."""

    def __init__(self, make, args):
        self.make = make
        self.args = args
        self.context = None

    @eager
    def __enter__(self):
        self.context = self.make(*self.args)
        return self.context.__enter__()

    @eager
    def __exit__(self, *exc_info):
        return self.context.__exit__(*exc_info)


def eager_context(make, *args):
    """The context manager `make(*args)`, made, entered and exited outside
    `torch.compile` on PyTorch; `make(*args)` itself elsewhere."""
    if not _on_torch():
        return make(*args)
    return _EagerContext(make, args)
