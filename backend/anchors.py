"""KVCOMM's anchors: a shared segment's KV in context, predicted from offsets measured
before (KVCOMM, "Online Cross-context KV-cache Communication for Efficient LLM-based
Multi-agent Systems"; github.com/FastMAS/KVCOMM).

A segment's K/V in a request's context = its base K/V (prefilled alone; keys before
RoPE, so any offset) + an offset its context adds. A placeholder is where a segment
sits: the same agent's j-th shared segment, round after round. Each time a request
is prefilled exactly, every segment's offset there (exact K/V - base) becomes an
anchor of its placeholder. A later segment in that place takes the anchors' offsets,
token by token (the anchors' first n tokens), weighted per token by a softmax over how
close each anchor's base is to its own base (mean absolute difference over layers,
heads and dims; KVCOMM's temperature 1). With several anchors whose weights say none
is near (the entropy of their softmax over whole-segment L2 distances above
`threshold` x log2(count), as KVCOMM's `predict_as_anchor`), the request is prefilled
exactly instead, and adds anchors.

Tensors are [layers from the check layer on, 2 (K, V), tokens, KV heads, head dim]:
layers before the check layer are computed for every token anyway.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

Place = tuple[str, str, int]  # (tenant, agent, ordinal of the shared segment in the prompt)


@dataclass(slots=True, eq=False)
class Anchor:
    base: torch.Tensor  # the segment's base K/V
    offset: torch.Tensor  # its exact K/V in that context, minus the base
    uses: int = 0  # requests whose prediction leaned on it most

    @property
    def n(self) -> int:
        return self.base.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.base.numel() * self.base.element_size()


class Anchors:
    """Per placeholder at most `per` anchors (a full one drops its least used, oldest
    first); placeholders least recently used go first past `budget` bytes."""

    def __init__(self, per: int, budget: int, threshold: float = 0.3, temperature: float = 1.0):
        self.per, self.budget = per, budget
        self.threshold, self.temperature = threshold, temperature
        self.places: OrderedDict[Place, list[Anchor]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(len(a) for a in self.places.values())

    def clear(self) -> None:
        self.places.clear()
        self.nbytes = 0

    def offset(self, place: Place, base: torch.Tensor) -> torch.Tensor | None:
        """The predicted offset of a segment whose base is `base` at `place`, or None:
        no anchor covers its length, or none of several is near (prefill it exactly)."""
        n = base.shape[2]
        found = [a for a in self.places.get(place, []) if a.n >= n]
        if not found:
            return None
        self.places.move_to_end(place)
        b = base.float()
        bases = torch.stack([a.base[:, :, :n] for a in found]).float()  # [A, L, 2, n, H, D]
        if len(found) > 1:
            dist = (bases[:, :, 1] - b[None, :, 1]).flatten(1).norm(dim=1)
            sim = torch.softmax(-dist, 0)
            entropy = -(sim * (sim + 1e-40).log2()).sum()
            if entropy > self.threshold * math.log2(len(found)):
                return None
            found[int(sim.argmax())].uses += 1
        else:
            found[0].uses += 1
        d = (bases - b[None]).abs().mean(dim=(1, 4, 5))  # [A, 2, n]
        w = torch.softmax(-d / self.temperature, 0)[:, None, :, :, None, None]
        offsets = torch.stack([a.offset[:, :, :n] for a in found]).float()
        return (w * offsets).sum(0).to(base.dtype)

    def add(self, place: Place, base: torch.Tensor, offset: torch.Tensor) -> None:
        """An anchor measured at place (tensors the pool's; kept, not copied)."""
        a = Anchor(base, offset)
        if a.nbytes > self.budget:
            return
        held = self.places.setdefault(place, [])
        self.places.move_to_end(place)
        if len(held) >= self.per:
            self._drop(place, min(range(len(held)), key=lambda i: held[i].uses))
        held.append(a)
        self.nbytes += a.nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self.places)), 0)

    def _drop(self, place: Place, i: int) -> None:
        held = self.places[place]
        self.nbytes -= held.pop(i).nbytes
        if not held:
            del self.places[place]
