"""Block tables of sequences over the pool, and exact prefix caching.

Policy on top of `BlockPool`: how many blocks a sequence needs, what it releases, and
which full blocks of a prompt can be taken from earlier sequences (a hash chain over
the tokens of every full block, as vLLM does it, started by the request's tenant:
backend/keys.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from tokendance.backend.keys import Key, chained, namespace
from tokendance.backend.pool import BlockPool
from tokendance.backend.sequence import Sequence


class BlockManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.size = block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.size)

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Grow seq's blocks to hold its first `tokens` tokens; False (and no change) if
        the pool is short."""
        need = self.blocks_for(seq.own_slots(tokens)) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.blocks.extend(self.pool.allocate() for _ in range(need))
        return True

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past what seq's tokens need (a Mirror whose patch room shrank)."""
        keep = self.blocks_for(seq.own_slots(len(seq)))
        while len(seq.blocks) > keep:
            self.pool.decref(seq.blocks.pop())

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.blocks):
            self.pool.decref(b)
        seq.blocks.clear()
        seq.hashes.clear()
        seq.reader = False  # a rerun may be a Mirror
        if seq.mirror is not None:  # its references to the Master; a rerun computes all
            for b in seq.mirror.master_blocks:
                self.pool.decref(b)
            seq.mirror = None
            seq.cached = seq.recomputed = 0

    def _keys(self, seq: Sequence, stop: int) -> Iterator[Key]:
        """Chain keys of seq's full blocks from the first without one up to block `stop`."""
        start = len(seq.hashes)
        prev = seq.hashes[-1] if start else namespace(seq.tenant, "prefix")
        return chained(prev, seq.tokens[start * self.size:stop * self.size], self.size)

    def _hits(self, seq: Sequence) -> Iterator[tuple[Key, int]]:
        """The cached blocks of the longest prefix of full blocks (short of the last
        token, so there is a step that samples)."""
        if not seq.prefix_cache or seq.blocks:
            return
        for h in self._keys(seq, (len(seq) - 1) // self.size):
            block = self.pool.lookup(h)
            if block is None:
                return
            yield h, block

    def cached(self, seq: Sequence) -> int:
        """Prompt tokens `match_prefix` would find now."""
        return sum(1 for _ in self._hits(seq)) * self.size

    def match_prefix(self, seq: Sequence) -> None:
        """Take the cached blocks of the sequence's longest cached prefix."""
        for h, block in self._hits(seq):
            self.pool.incref(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
        seq.computed = len(seq.blocks) * self.size
        seq.cached = max(seq.cached, min(seq.computed, len(seq.prompt)))

    def publish(self, seq: Sequence) -> None:
        """Make the sequence's newly completed full blocks findable, those of exact K/V
        only (a restored prefix may hold predicted K/V past seq.exact)."""
        if not seq.prefix_cache:
            return
        known = min(seq.computed, len(seq) - seq.lookahead, seq.exact)  # read by the host, and exact
        for h in self._keys(seq, known // self.size):
            self.pool.publish(seq.blocks[len(seq.hashes)], h)
            seq.hashes.append(h)
