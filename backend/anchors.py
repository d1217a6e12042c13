"""Anchors: a shared segment's KV in context, predicted from offsets measured before
(KVCOMM, "Online Cross-context KV-cache Communication for Efficient LLM-based
Multi-agent Systems"; github.com/FastMAS/KVCOMM).

A segment's K/V in a request's context = its base K/V (prefilled alone; keys before
RoPE, so any offset) + an offset its context adds. A placeholder is where a segment
sits: the same agent's j-th shared segment, round after round. Each time a request is
prefilled exactly, every segment's offset there (exact K/V - base) becomes an anchor of
its placeholder. KVCOMM's finding is that tokens whose K/V lie close have offsets that
lie close. It weights whole anchors position by position (an anchor's token t for the
segment's token t); here each token of a new segment takes the offset of the token
among its placeholder's anchors whose base lies nearest (L2 over every layer from the
check layer on, K and V matched apart). On SmolLM2's debate (round 3 from round-2
anchors, 4 agents, 2 questions) that left the V of layer 29 0.33 from exact against
KVCOMM's 0.48 and the bare base's 0.76 (docs/fidelity.md).

Tensors are [layers from the check layer on, 2 (K, V), tokens, KV heads, head dim]:
layers before the check layer are computed for every token anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

Place = tuple[str, str, int]  # (tenant, agent, ordinal of the shared segment in the prompt)


@dataclass(slots=True, eq=False)
class Anchor:
    base: torch.Tensor  # the segment's base K/V
    offset: torch.Tensor  # its exact K/V in that context, minus the base

    @property
    def nbytes(self) -> int:
        return 2 * self.base.numel() * self.base.element_size()


def _rows(kv: torch.Tensor) -> torch.Tensor:
    """[L, 2, n, H, D] -> [2, n, L*H*D] in float32: one row per token, K and V apart."""
    return kv.permute(1, 2, 0, 3, 4).flatten(2).float()


class Anchors:
    """Per placeholder its `per` latest anchors (a context several rounds old has moved
    on); placeholders least recently used go first past `budget` bytes."""

    def __init__(self, per: int, budget: int):
        self.per, self.budget = per, budget
        self.places: OrderedDict[Place, list[Anchor]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(len(a) for a in self.places.values())

    def clear(self) -> None:
        self.places.clear()
        self.nbytes = 0

    def offset(self, place: Place, base: torch.Tensor) -> torch.Tensor | None:
        """The predicted offset of a segment whose base is `base` at `place`, or None
        where no anchor was measured (prefill it exactly)."""
        held = self.places.get(place)
        if not held:
            return None
        self.places.move_to_end(place)
        bases = _rows(torch.cat([a.base for a in held], 2))  # [2, S, F]
        near = torch.cdist(_rows(base), bases).argmin(-1)  # [2, n]: per token, K and V apart
        offsets = torch.cat([a.offset for a in held], 2).permute(1, 2, 0, 3, 4)  # [2, S, L, H, D]
        picked = torch.stack([offsets[0, near[0]], offsets[1, near[1]]])  # [2, n, L, H, D]
        return picked.permute(2, 0, 1, 3, 4).to(base.dtype)

    def add(self, place: Place, base: torch.Tensor, offset: torch.Tensor) -> None:
        """An anchor measured at place (tensors the pool's; kept, not copied)."""
        a = Anchor(base, offset)
        if a.nbytes > self.budget:
            return
        held = self.places.setdefault(place, [])
        self.places.move_to_end(place)
        if len(held) >= self.per:
            self._drop(place)
        held.append(a)
        self.nbytes += a.nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self.places)))

    def _drop(self, place: Place) -> None:
        """The oldest anchor of place."""
        held = self.places[place]
        self.nbytes -= held.pop(0).nbytes
        if not held:
            del self.places[place]
