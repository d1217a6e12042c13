"""The host tier on CPU: Master once + private diffs, bit-exact restore, references, LRU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tokendance.backend.model import KVCache
from tokendance.backend.offload import HostTier

LAYERS, HKV, D, B = 3, 2, 8, 4
TOKEN = LAYERS * 2 * HKV * D * 4  # bytes of one token's K/V in every layer, float32


def make_cache(blocks: int = 64, seed: int = 0) -> KVCache:
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    cache = KVCache(cfg, blocks, B, torch.float32, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def budgeted(tokens: int, seed: int) -> tuple[HostTier, Slots]:
    """A host tier of `tokens` tokens' budget over a fresh cache, and slots to park."""
    cache = make_cache()
    return HostTier(cache, tokens * TOKEN, page=1), Slots(cache.num_blocks, seed)


def kv_of(cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    return cache.kv.view(LAYERS, 2, -1, HKV, D)[:, :, slots].clone()


class Slots:
    """Hands out flat slots from shuffled blocks; the last block of a run may be partial."""

    def __init__(self, blocks: int, seed: int):
        self.free = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, n: int) -> torch.Tensor:
        blocks = [self.free.pop() for _ in range(math.ceil(n / B))]
        return torch.tensor([b * B + o for b in blocks for o in range(B)][:n])


def round_of(cache: KVCache, tier: HostTier, agents: int = 3, master: int = 10, seed: int = 1):
    """One Master of `master` tokens and `agents` agents of 5 + i private tokens, parked."""
    alloc = Slots(cache.num_blocks, seed)
    mslots = alloc.take(master)
    tier.put_master(7, mslots)
    private = {f"a{i}": alloc.take(5 + i) for i in range(agents)}
    for name, slots in private.items():
        assert tier.park(name, slots, [7]) == len(slots) * TOKEN
    return mslots, private


def test_master_once_and_bit_exact_restore():
    cache = make_cache()
    tier = HostTier(cache, 1 << 30, page=1)
    mslots, private = round_of(cache, tier)
    assert tier.bytes == (10 + 5 + 6 + 7) * TOKEN  # the Master once, not per agent
    want = {n: kv_of(cache, s) for n, s in private.items()}
    want_m = kv_of(cache, mslots)
    cache.kv.fill_(math.nan)
    alloc = Slots(cache.num_blocks, 99)
    mdst = alloc.take(10)
    dst = {n: alloc.take(len(s)) for n, s in private.items()}
    tier.restore(list(dst.items()), {7: mdst})
    for n in private:
        assert torch.equal(kv_of(cache, dst[n]), want[n])
        assert n not in tier
    assert torch.equal(kv_of(cache, mdst), want_m)
    named = torch.cat([mdst, *dst.values()])
    rest = torch.ones(cache.kv[0, 0].flatten(0, 1).shape[0], dtype=torch.bool)
    rest[named] = False
    assert cache.kv.view(LAYERS, 2, -1, HKV, D)[:, :, rest].isnan().all()
    tier.release_master(7)
    assert tier.bytes == 0 and not tier.masters


def test_dense_baseline_is_the_same_api():
    cache = make_cache()
    tier = HostTier(cache, 1 << 30, page=1)
    slots = Slots(cache.num_blocks, 3).take(13)
    want = kv_of(cache, slots)
    assert tier.park("d", slots, []) == 13 * TOKEN
    cache.kv.zero_()
    dst = Slots(cache.num_blocks, 4).take(13)
    tier.restore([("d", dst)], {})
    assert torch.equal(kv_of(cache, dst), want) and tier.bytes == 0


def test_master_freed_with_its_last_reader():
    cache = make_cache()
    tier = HostTier(cache, 1 << 30, page=1)
    mslots, private = round_of(cache, tier)
    tier.put_master(7, mslots)  # a second put: a reference, no second copy
    assert tier.bytes == (10 + 18) * TOKEN
    tier.release_master(7)
    tier.release_master(7)
    assert 7 in tier.masters  # the agents still read it
    tier.restore([("a0", Slots(cache.num_blocks, 5).take(5))], {})
    tier.drop("a1")
    assert 7 in tier.masters and tier.bytes == (10 + 7) * TOKEN
    tier.drop("a2")
    assert not tier.masters and tier.bytes == 0
    tier.put_master(8, mslots)
    tier.park("b", mslots[:2], [8])
    tier.release_master(8)
    with pytest.raises(ValueError, match="no put reference"):
        tier.release_master(8)
    tier.drop("b")
    with pytest.raises(KeyError, match="Master 8 is not on the host"):
        tier.release_master(8)


def test_park_replaces_and_lru_eviction():
    tier, alloc = budgeted(20, 6)
    for name in ("a", "b", "c"):
        assert tier.park(name, alloc.take(6), []) == 6 * TOKEN
    assert tier.park("a", alloc.take(4), []) == 4 * TOKEN  # replaces a: now the newest
    assert tier.bytes == 16 * TOKEN
    assert tier.park("d", alloc.take(12), []) == 12 * TOKEN  # evicts b, then c
    assert "b" not in tier and "c" not in tier and "a" in tier and "d" in tier
    assert tier.bytes == 16 * TOKEN


def test_a_taken_agent_is_never_evicted():
    """An agent whose next request will restore it stays until restored or dropped:
    parking others evicts the agents nobody takes, and refuses what cannot fit beside it."""
    tier, alloc = budgeted(20, 9)
    tier.put_master(1, alloc.take(4))
    tier.park("a", alloc.take(6), [1])
    tier.release_master(1)  # only a holds it now
    tier.park("b", alloc.take(4), [])
    tier.take("a")
    assert tier.park("c", alloc.take(7), []) == 7 * TOKEN  # evicts b, the newer one
    assert "a" in tier and "b" not in tier and tier.bytes == 17 * TOKEN
    assert tier.park("d", alloc.take(11), []) == 0  # only c may go: a and its Master stay
    assert "a" in tier and "c" in tier and "d" not in tier
    dst = alloc.take(6)
    tier.restore([("a", dst)], {})
    assert "a" not in tier and 1 not in tier.masters and tier.bytes == 7 * TOKEN
    with pytest.raises(KeyError, match="take: agent 'a' is not parked"):
        tier.take("a")


def test_agent_bigger_than_budget_is_refused():
    tier, alloc = budgeted(20, 7)
    tier.put_master(1, alloc.take(10))
    assert tier.park("small", alloc.take(4), [1]) == 4 * TOKEN
    assert tier.park("huge", alloc.take(21), []) == 0
    assert tier.park("big", alloc.take(11), [1]) == 0  # with its Master it cannot fit
    assert "huge" not in tier and "big" not in tier and "small" in tier
    assert tier.bytes == 14 * TOKEN
    tier.drop("small")
    tier.release_master(1)
    assert tier.bytes == 0


def test_eviction_keeps_the_masters_the_new_agent_reads():
    tier, alloc = budgeted(24, 8)
    tier.put_master(1, alloc.take(10))
    tier.park("a", alloc.take(6), [1])
    tier.release_master(1)  # only a holds it now
    assert tier.park("b", alloc.take(10), [1]) == 10 * TOKEN  # evicts a, keeps Master 1
    assert "a" not in tier and tier.masters[1].readers == 1
    assert tier.bytes == 20 * TOKEN


def test_bad_restores_raise_and_change_nothing():
    cache = make_cache()
    tier = HostTier(cache, 1 << 30, page=1)
    mslots, private = round_of(cache, tier)
    before = cache.kv.clone()
    with pytest.raises(KeyError, match="agent 'ghost' is not parked"):
        tier.restore([("a0", private["a0"]), ("ghost", private["a1"])], {})
    with pytest.raises(KeyError, match="Master 9 is not on the host"):
        tier.restore([("a0", private["a0"])], {9: mslots})
    with pytest.raises(ValueError, match="a1 holds 6 tokens"):
        tier.restore([("a0", private["a0"]), ("a1", private["a0"])], {})
    with pytest.raises(ValueError, match="Master 7 holds 10 tokens"):
        tier.restore([], {7: mslots[:3]})
    with pytest.raises(ValueError, match="named twice"):
        tier.restore([("a0", private["a0"]), ("a0", private["a0"])], {})
    with pytest.raises(ValueError, match="must lie in"):
        tier.restore([("a0", private["a0"] + 10**6)], {})
    with pytest.raises(KeyError, match="put_master it first"):
        tier.park("x", private["a0"], [3])
    assert torch.equal(cache.kv, before) and len(tier) == 3
