"""Idle agents: an agent's KV parked in host memory between its rounds, restored fused.

When a reusing request that names its agent (session/agent) finishes, its KV is parked
in the host tier (backend/offload.py) instead of being thrown away: a Mirror as its
private slots plus each Master segment once (shared by every agent that read it), a
plain sequence (kvcomm's are) as its slots. When the agent's next request arrives and
its prompt starts with the parked tokens (an agent's next prompt is its last one, its
answer, and the round's new outputs), that prefix is restored instead of prefilled: the
private slots into the new request's own blocks, each Master segment back into the
segment cache unless it is still there, all of a group in one host-to-device copy and
one scatter launch. A restored Mirror stays a Mirror: its old patches stay patches, its
reused tokens read the Master again; only the rest of the prompt is prefilled
(backend/blend.py). A request with a dense cache (kvcomm) restores only a plain parked
prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokendance.backend.mirror import EARLY, LATE, Mirror, Span
from tokendance.backend.model import KVCache
from tokendance.backend.offload import HostTier
from tokendance.backend.pool import flat_slots
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload


@dataclass(slots=True)
class Parked:
    tokens: list[int]  # the tokens whose KV is parked (the finished request's computed ones)
    mirror: Mirror | None  # its layout (block ids in it are stale), None for a plain one
    slots: int  # private slots parked, in slot order
    exact: int = 0  # tokens from the start whose K/V an exact prefill would give (kvcomm measures there)


@dataclass(slots=True)
class Resume:
    """A request's restorable prefix: the first `length` tokens come from `parked`."""

    name: str
    parked: Parked
    length: int

    @property
    def exact(self) -> int:
        """Restored tokens from the start whose K/V are an exact prefill's."""
        return min(self.parked.exact, self.length)


def _tokens(parked: Parked) -> torch.Tensor:
    """The token whose K/V each parked private slot holds (-1: unused patch room)."""
    i = torch.arange(parked.slots)
    m = parked.mirror
    if m is None:
        return i
    head = i.clamp_max(m.area - 1)
    late, early = m.own_pos[LATE][head], m.own_pos[EARLY][head]
    return torch.where(i >= m.area, m.prompt_len + i - m.area, torch.where(late >= 0, late, early))


class IdleAgents:
    def __init__(self, cache: KVCache, budget_bytes: int, ranks: int = 1):
        """budget_bytes: the host tier's over every tensor-parallel rank; a rank holds
        1/ranks of each token's K/V, so the same agents in 1/ranks of the bytes."""
        self.cache = cache
        try:
            self.tier = HostTier(cache, budget_bytes, ranks=ranks)
        except ValueError as e:  # the arena speaks of its rank's share: name the whole
            if ranks == 1:
                raise
            raise ValueError(f"{e}; each of the {ranks} ranks holds 1/{ranks} of the {budget_bytes:,} given") from None
        self.parked: dict[str, Parked] = {}
        self.restored = 0  # prompt tokens restored instead of prefilled, all requests

    @property
    def bytes(self) -> int:
        return self.tier.bytes

    def park(self, name: str, seq: Sequence) -> None:
        """Keep a finished request's KV for its agent's next request (seq still holds its
        blocks). Not while another request of the agent restores its parked KV: that
        one parks when it ends."""
        if self.tier.taken(name):
            return
        self.drop(name)
        tokens = seq.tokens[: seq.computed]
        if not tokens or not seq.blocks:
            return
        b, dev = self.cache.block_size, self.cache.kv.device
        n = seq.own_slots(len(tokens))
        spans = seq.mirror.spans if seq.mirror is not None else []
        # On the host a Master is its version: another agent may have read other K/V
        # under the same key, and each must get back what it was computed with.
        put = []
        for sp in spans:
            if not self.tier.put_master(sp.version, upload(flat_slots(sp.blocks, torch.arange(sp.n), b), dev)):
                break  # no room even for the Masters: not parked
            put.append(sp.version)
        held = len(put) == len(spans) and self.tier.park(
            name, upload(flat_slots(seq.blocks, torch.arange(n), b), dev), put)
        for version in put:
            self.tier.release_master(version)
        if held:
            self.parked[name] = Parked(tokens, seq.mirror, n, min(seq.exact, len(tokens)))
        for gone in [k for k in self.parked if k not in self.tier]:  # evicted for budget
            del self.parked[gone]

    def drop(self, name: str) -> None:
        self.parked.pop(name, None)
        self.tier.drop(name)

    def forgo(self, seq: Sequence) -> None:
        """seq gives up the parked prefix it was to restore (it is prefilled whole, or
        aborted): the host tier lets it go."""
        if seq.resume is not None:
            self.tier.drop(seq.resume.name)
            seq.resume = None

    def take(self, name: str, prompt: list[int], shared: list[tuple[int, int]],
             dense: bool = False) -> Resume | None:
        """The agent's parked prefix of `prompt`, if one is worth restoring: the longest
        common prefix, short of the last prompt token (it samples) and of any segment
        it would cut. A mismatch forgets what was parked: the agent moved on. `dense`:
        the request holds its every token (no Mirror), so a parked Mirror is no use."""
        p = self.parked.pop(name, None)
        if p is None or name not in self.tier:  # never parked, or evicted for budget
            return None
        if dense and p.mirror is not None:
            self.tier.drop(name)
            return None
        n = 0
        for a, c in zip(p.tokens, prompt[:-1]):
            if a != c:
                break
            n += 1
        cuts = list(shared) + [(sp.lo, sp.lo + sp.n) for sp in (p.mirror.spans if p.mirror else [])]
        while any(lo < n < hi for lo, hi in cuts):
            n = min(lo for lo, hi in cuts if lo < n < hi)
        if n < self.cache.block_size:
            self.tier.drop(name)
            return None
        self.tier.take(name)  # until its group restores it: agents parked meanwhile evict others
        return Resume(name, p, n)

    # -- restore -------------------------------------------------------------------

    def private_slots(self, r: Resume, seq: Sequence) -> torch.Tensor:
        """Destination of each parked private slot in seq (reserved for its prompt):
        its token's own slot there, the trash slot for tokens past the prefix."""
        j = _tokens(r.parked)
        inside = (j >= 0) & (j < r.length)
        j = j.clamp(0, r.length - 1)
        k = torch.where(inside, j if seq.mirror is None else seq.mirror.own_of[j], -1)
        out = torch.where(k >= 0, flat_slots(seq.blocks, k.clamp_min(0), self.cache.block_size),
                          self.cache.trash)
        return upload(out, self.cache.kv.device)

    def restore(self, items: list[tuple[Resume, Sequence]], masters: dict[int, torch.Tensor]) -> None:
        """One fused restore: each resumed request's private slots, and the Masters in
        `masters` (version -> destination slots) once."""
        self.tier.restore([(r.name, self.private_slots(r, seq)) for r, seq in items], masters)
        self.restored += sum(r.length for r, _ in items)


def resumed_mirror(r: Resume, prompt_len: int, old_spans: list[Span], new_spans: list[Span],
                   reused_tail: list[bool], dense_early: bool, ratio: float) -> Mirror:
    """The Mirror of a request whose first r.length tokens are restored: the parked
    Mirror's spans (old_spans: the same segments, their Master blocks now) and
    patches, then the new segments (new_spans, reused_tail: per token from r.length on,
    which are reused) with patch room for the share `ratio` of them."""
    old = r.parked.mirror
    head = torch.zeros(r.length, dtype=torch.bool)
    patches: list[int] = []
    if old is not None:
        n = min(r.length, old.prompt_len)
        head[:n] = old.reused[:n]
        # A reused token with a private slot in the late view is a patch.
        patches = torch.nonzero(head[:n] & (old.own_index(LATE, torch.arange(n)) >= 0)).flatten().tolist()
    reused = head.tolist() + reused_tail
    cap = len(patches) + math.ceil(ratio * sum(reused_tail))
    m = Mirror.build(prompt_len, old_spans + new_spans, reused, dense_early, cap)
    m.pick(patches)
    return m
