"""The Masters a group's restored prefixes read, back in the segment cache.

A parked agent (backend/idle.py) read each of its shared segments from one version of
that segment's base K/V (segments.Entry.version), and its private slots were computed
against it. Its prefix can be restored only with those K/V: the version still in the
segment cache, or the one the host tier kept, put back into the cache. When the cache
holds another version under the key (a new reader base, a producer base that replaced
a standalone one), the agent is prefilled whole instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.detok import Detok
from tokendance.backend.idle import IdleAgents, Resume
from tokendance.backend.keys import Key
from tokendance.backend.mirror import EARLY, Span
from tokendance.backend.segments import Entry, SegmentCache
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload


def parked_spans(r: Resume) -> list[Span]:
    """The parked Mirror's spans that lie inside the restored prefix."""
    m = r.parked.mirror
    return [sp for sp in (m.spans if m is not None else []) if sp.lo + sp.n <= r.length]


def restorable(r: Resume, entries: dict[Key, Entry]) -> bool:
    """Whether every Master r's prefix read is in `entries` with the K/V it read."""
    return all((e := entries.get(sp.key)) is not None and e.version == sp.version for sp in parked_spans(r))


def bring_back(group: list[Sequence], segments: SegmentCache, idle: IdleAgents,
               reserve: Callable[[Sequence, int], bool], block_size: int, device: torch.device,
               pinned: list[Entry], entered: list[Entry]) -> dict[int, torch.Tensor]:
    """Pin the Masters that resumed requests of `group` read, and put those that left
    the GPU back into the segment cache (`entered` gets them): fresh blocks, to be
    filled by the fused restore (version -> their slots). A request whose Masters
    cannot all come back as it read them is not resumed."""
    out: dict[int, torch.Tensor] = {}
    for seq in group:
        r = seq.resume
        if r is None:
            continue
        mine: dict[int, torch.Tensor] = {}  # Masters it puts back, restored only if all come
        held: list[Entry] = []
        for sp in parked_spans(r):
            if sp.version in out or sp.version in mine:
                continue
            e = segments.get(sp.key)
            if e is not None:
                if e.version != sp.version:
                    break  # other K/V under its key now
                segments.pin(e)  # still here: pinned, no prefill of this step evicts it
                pinned.append(e)
                continue
            holder = Sequence(f"master-{sp.key.hex()}", [0] * sp.n, SamplingParams(), Detok(None))
            if not reserve(holder, sp.n):
                break
            e = segments.put(sp.key, sp.n, holder.blocks, sp.source, sp.version)
            if e is None or e.blocks is not holder.blocks:  # the cache had no room
                break
            segments.pin(e)
            pinned.append(e)
            held.append(e)
            entered.append(e)
            mine[sp.version] = upload(holder.slots(torch.arange(sp.n), EARLY, block_size, -1), device)
        else:
            out.update(mine)
            continue
        # Its prefix is prefilled instead: the Masters it put back would never be
        # filled (and dropping it may free them on the host), so they leave the cache.
        for e in held:
            segments.discard(e)
        idle.forgo(seq)
    return out
