"""The segment cache: base KV of shared segments, keyed by content, not position.

An entry holds the K/V of a segment's tokens in pool blocks, laid out from slot 0 of
its first block (keys before RoPE, so the same blocks serve any offset). Three kinds
of base: `producer` (the KV the agent that wrote the text computed while generating it,
in its own context), `reader` (the KV of the segment in a request of the round that read
it, prefilled in full) and `standalone` (the segment prefilled alone). A producer base is
preferred and replaces any other. Entries are reference-counted through the
pool; the least recently used are evicted past a byte budget.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokendance.backend.api import InvalidRequest
from tokendance.backend.keys import Key
from tokendance.backend.pool import BlockPool

# On the H200, tool rounds whose shared answers were 32 tokens each took 1.02-1.09x
# `full`'s time with them reused and 0.84-0.87x with them computed as private tokens;
# the All-Gather round's 150-token outputs reused gave 2.1x (docs/benchmarks.md).
CUDA_MIN_SHARED = 64

def check_spans(spans: list[tuple[int, int]], prompt_len: int) -> list[tuple[int, int]]:
    """A request's shared spans in order; InvalidRequest unless each is a non-empty
    [lo, hi) inside the prompt and none overlaps another."""
    out = sorted((int(lo), int(hi)) for lo, hi in spans)
    end = 0
    for lo, hi in out:
        if not 0 <= lo < hi <= prompt_len:
            raise InvalidRequest(f"shared span [{lo}, {hi}) is not a non-empty span of the "
                                 f"{prompt_len}-token prompt", "shared")
        if lo < end:
            raise InvalidRequest(f"shared span [{lo}, {hi}) overlaps the one before it", "shared")
        end = hi
    return out


def min_shared(given: int | None, device: torch.device) -> int:
    """The shortest shared segment reused on `device`: `given`, or 64 tokens on CUDA and
    any length on the CPU, whose compute every reused token saves."""
    if given is None:
        return CUDA_MIN_SHARED if device.type == "cuda" else 0
    if type(given) is not int or given < 0:
        raise InvalidRequest(f"min_shared_tokens must be a non-negative integer, got {given!r}",
                             "min_shared_tokens")
    return given


@dataclass(slots=True)
class Entry:
    key: Key
    ntokens: int
    blocks: list[int]
    source: str  # "producer" | "reader" | "standalone"
    # Which K/V: a key's base changes when a new one replaces it, or when it is computed
    # again after an eviction (a reader base in another reader's context). Unique per put.
    version: int = 0
    pins: int = 0  # in-flight requests reading it


class SegmentCache:
    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int):
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.entries: OrderedDict[Key, Entry] = OrderedDict()
        self.held = 0  # blocks held by entries
        self._versions = itertools.count(1)

    def get(self, key: Key) -> Entry | None:
        e = self.entries.get(key)
        if e is not None:
            self.entries.move_to_end(key)
        return e

    def put(self, key: Key, ntokens: int, blocks: list[int], source: str,
            version: int | None = None) -> Entry | None:
        """Take ownership of `blocks` (one reference each). Keeps an existing producer
        base over anything new, and a new producer base over a standalone one. `version`:
        the one these K/V had before (a Master back from the host), else a new one."""
        old = self.entries.get(key)
        if old is not None and (old.source == "producer" or source == "standalone"):
            self._release(blocks)
            return old
        if old is not None:
            self._drop(old)
        e = Entry(key, ntokens, blocks, source, next(self._versions) if version is None else version)
        self.entries[key] = e
        self.held += len(blocks)
        self.evict(0)
        return self.entries.get(key)

    def evict(self, need: int) -> int:
        """Drop unpinned LRU entries until `need` more blocks fit the budget and the pool;
        returns how many blocks were released."""
        freed = 0
        for e in list(self.entries.values()):
            over = self.held > self.max_blocks
            short = self.pool.num_free < need  # a dropped entry's blocks are already back
            if not over and not short:
                break
            if e.pins == 0:
                freed += len(e.blocks)
                self._drop(e)
        return freed

    def pin(self, e: Entry) -> None:
        e.pins += 1

    def unpin(self, e: Entry) -> None:
        e.pins -= 1

    def discard(self, e: Entry) -> None:
        """Drop this entry, pinned or not, if it is still the one under its key."""
        if self.entries.get(e.key) is e:
            self._drop(e)

    def clear(self) -> None:
        for e in list(self.entries.values()):
            if e.pins == 0:
                self._drop(e)

    def _drop(self, e: Entry) -> None:
        del self.entries[e.key]
        self.held -= len(e.blocks)
        self._release(e.blocks)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pool.decref(b)
