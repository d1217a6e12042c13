"""One request's tokens, block table and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.detok import Detok


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Sequence:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    detok: Detok
    generator: torch.Generator | None = None
    out: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the pool
    cached: int = 0  # prompt tokens whose K/V was reused rather than computed
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    prefix_cache: bool = False  # may reuse / publish exact prefix blocks
    hashes: list[int] = field(default_factory=list)  # chain hash of each full block

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out if self.out else self.prompt

    def __len__(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self) - self.computed
