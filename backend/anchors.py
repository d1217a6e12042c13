"""Anchors: a shared segment's KV in context, predicted from offsets measured before
(KVCOMM, "Online Cross-context KV-cache Communication for Efficient LLM-based
Multi-agent Systems"; github.com/FastMAS/KVCOMM).

A segment's K/V in a request's context = its base K/V (prefilled alone; keys before
RoPE, so any offset) + an offset its context adds. A placeholder is where a segment
sits, round after round (backend/kvcomm.py names them: an agent's j-th shared segment
from the prompt's end). Each time a request is prefilled exactly, every segment's offset
there (exact K/V - base) becomes an anchor of its placeholder. KVCOMM's finding is that tokens whose K/V lie close have offsets that
lie close. It weights whole anchors position by position (an anchor's token t for the
segment's token t); here each token of a new segment takes the offset of the token
among its placeholder's anchors whose base lies nearest (L2 over every layer from the
check layer on, K and V matched apart). On SmolLM2's debate (round 3 from round-2
anchors, 4 agents, 2 questions) that left the V of layer 29 0.33 from exact against
KVCOMM's 0.48 and the bare base's 0.76 (docs/fidelity.md).

Tensors are [layers from the check layer on, 2 (K, V), tokens, KV heads, head dim]:
layers before the check layer are computed for every token anyway. An anchor may be
held low-rank (backend/lowrank.py, KVCMAS's anchors); it is read back whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokendance.backend.lowrank import LowRank, dense, nbytes
from tokendance.backend.parallel import Shard

Place = tuple  # (mode, tenant, agent, where): backend/kvcomm.py names the places


@dataclass(slots=True, eq=False)
class Anchor:
    held_offset: torch.Tensor | LowRank  # the segment's K/V in that context, minus its base
    held_base: torch.Tensor | LowRank | None = None  # its base K/V, where tokens are matched against it

    @property
    def offset(self) -> torch.Tensor:
        return dense(self.held_offset)

    @property
    def base(self) -> torch.Tensor | None:
        return None if self.held_base is None else dense(self.held_base)

    @property
    def nbytes(self) -> int:
        return nbytes(self.held_offset) + nbytes(self.held_base)


def _rows(kv: torch.Tensor) -> torch.Tensor:
    """[L, 2, n, H, D] -> [2, n, L*H*D] in float32: one row per token, K and V apart."""
    return kv.permute(1, 2, 0, 3, 4).flatten(2).float()


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[2, n_i, F] each -> [G, 2, width, F], zero-padded."""
    return torch.stack([torch.nn.functional.pad(r, (0, 0, 0, width - r.shape[1])) for r in rows])


class Anchors:
    """Per placeholder its `per` latest anchors (a context several rounds old has moved
    on); placeholders least recently used go first past `budget` bytes. A tensor two
    anchors hold (a measured offset is also what its text read there) counts once. With
    tensor parallelism (`tp`) the nearest anchor is the nearest over every rank's heads."""

    def __init__(self, per: int, budget: int, tp: Shard | None = None):
        self.per, self.budget, self.tp = per, budget, tp
        self.places: OrderedDict[Place, list[Anchor]] = OrderedDict()
        self.nbytes = 0
        self.refs: dict[int, int] = {}  # id of a held tensor -> anchors holding it

    def __len__(self) -> int:
        return sum(len(a) for a in self.places.values())

    def clear(self) -> None:
        self.places.clear()
        self.refs.clear()
        self.nbytes = 0

    def get(self, place: Place) -> Anchor | None:
        """The latest anchor of place."""
        held = self.places.get(place)
        if not held:
            return None
        self.places.move_to_end(place)
        return held[-1]

    def offsets(self, places: list[Place], bases: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """The predicted offsets of a request's segments, their bases side by side in
        `bases` (sizes[i] tokens of segment i, at places[i]), in one batched search; None
        where a place has no anchor (prefill the request exactly)."""
        pools = [self.places.get(p) for p in places]
        if not all(pools):
            return None
        for p in places:
            self.places.move_to_end(p)
        pool_b = [torch.cat([a.base for a in held], 2) for held in pools]
        pool_o = [torch.cat([a.offset for a in held], 2) for held in pools]
        lens = torch.tensor([b.shape[2] for b in pool_b], device=bases.device)
        width = int(lens.max())
        q = _padded([_rows(b) for b in bases.split(sizes, 2)], max(sizes))  # [G, 2, n, F]
        p = _padded([_rows(b) for b in pool_b], width)  # [G, 2, s, F]
        d = torch.cdist(q, p)  # [G, 2, n, s]: per token, K and V apart
        if self.tp is not None:  # squared distances add up over the ranks' heads
            d = self.tp.sum(d.square_())
        d.masked_fill_(torch.arange(width, device=d.device) >= lens[:, None, None, None], float("inf"))
        near = d.argmin(-1)  # [G, 2, n]
        o = _padded([x.permute(1, 2, 0, 3, 4).flatten(2) for x in pool_o], width)  # [G, 2, s, L*H*D]
        picked = o.gather(2, near[..., None].expand(-1, -1, -1, o.shape[-1]))  # [G, 2, n, L*H*D]
        L, _, _, H, D = bases.shape
        return torch.cat([picked[g, :, :n].reshape(2, n, L, H, D) for g, n in enumerate(sizes)], 1
                         ).permute(2, 0, 1, 3, 4)

    def add(self, place: Place, offset: torch.Tensor | LowRank, base: torch.Tensor | LowRank | None = None,
            per: int | None = None) -> None:
        """An anchor measured at place (its tensors kept as given: the caller's own); the
        place keeps `per` (default: the pool's) latest."""
        a = Anchor(offset, base)
        if a.nbytes > self.budget:
            return
        held = self.places.setdefault(place, [])
        self.places.move_to_end(place)
        held.append(a)
        self._count(a, 1)
        while len(held) > (per or self.per):
            self._count(held.pop(0), -1)
        while self.nbytes > self.budget:
            self._drop(next(iter(self.places)))

    def _count(self, a: Anchor, step: int) -> None:
        """a's tensors held (+1) or let go (-1): their bytes count while any anchor holds them."""
        for t in (a.held_offset, a.held_base):
            if t is None:
                continue
            n = self.refs.get(id(t), 0) + step
            if n == 0:
                del self.refs[id(t)]
            else:
                self.refs[id(t)] = n
            if n == (1 if step > 0 else 0):
                self.nbytes += step * nbytes(t)

    def _drop(self, place: Place) -> None:
        """The oldest anchor of place."""
        held = self.places[place]
        self._count(held.pop(0), -1)
        if not held:
            del self.places[place]
