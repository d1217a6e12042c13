"""Physical KV blocks: free list, reference counts, content hashes for prefix hits.

Mechanism only: the pool knows nothing about sequences, rounds or models. A freed block
that carries a hash stays findable until it is handed out again (LRU), which is what
makes exact prefix caching free.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tokendance.backend.keys import Key


class OutOfBlocks(RuntimeError):
    pass


def flat_slots(blocks: list[int], idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots (block * block_size + offset) of the slots `idx` of a block list."""
    return torch.tensor(blocks, dtype=torch.long)[idx // block_size] * block_size + idx % block_size


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.hash_of: list[Key | None] = [None] * num_blocks
        self.by_hash: dict[Key, int] = {}
        # Free blocks in LRU order; hashed ones stay findable until reused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocks("KV pool is full")
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[block] = None
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        refs = self.refs[block] - 1
        assert refs >= 0, f"block {block} freed twice"
        self.refs[block] = refs
        if refs == 0:
            self.free[block] = None

    def forget(self) -> None:
        """Drop every content hash: no later request hits what earlier ones left."""
        for h, b in self.by_hash.items():
            self.hash_of[b] = None
        self.by_hash.clear()

    def lookup(self, h: Key) -> int | None:
        return self.by_hash.get(h)

    def publish(self, block: int, h: Key) -> None:
        """Make a full block findable by the hash of its content (and its prefix)."""
        if h in self.by_hash or self.hash_of[block] is not None:
            return
        self.hash_of[block] = h
        self.by_hash[h] = block
