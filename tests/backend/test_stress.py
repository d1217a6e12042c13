"""Robustness under load: a small KV pool, many requests, reuse modes side by side."""

from __future__ import annotations

from tokendance.backend.pool import BlockPool
from tokendance.backend.segments import SegmentCache


def test_evict_drops_bases_until_the_pool_has_room():
    """A dropped base's blocks are already back in the pool: they count once."""
    pool = BlockPool(10)
    cache = SegmentCache(pool, 16, max_blocks=10)
    for key in (1, 2):
        cache.put(key, 32, [pool.allocate(), pool.allocate()], "standalone")
    assert pool.num_free == 6
    cache.evict(9)
    assert pool.num_free == 10 and not cache.entries
