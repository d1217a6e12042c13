"""Whether a model's layers draw random weights as they are built, as torch's layers do: a
random-weight model (a shape the benches serve) draws them; a model a checkpoint fills next
is built without, so a load does not draw what it overwrites (SmolLM2 on the CPU: about
1 s of a 1.3 s load). Its parameters then hold whatever memory held until the loader
writes them (backend/place.py checks every one is written).

A context variable, not a patch of torch's classes: a build in another thread is not
affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import nn

DRAW: ContextVar[bool] = ContextVar("draw", default=True)


@contextmanager
def drawing(on: bool) -> Iterator[None]:
    """Layers built within draw their weights (`on`) or leave them unwritten."""
    token = DRAW.set(on)
    try:
        yield
    finally:
        DRAW.reset(token)


class Drawn:
    """A torch layer whose `reset_parameters` (its random start) runs only while `DRAW` is on."""

    def reset_parameters(self) -> None:
        if DRAW.get():
            super().reset_parameters()


class Linear(Drawn, nn.Linear):
    pass


class Embedding(Drawn, nn.Embedding):
    pass
