"""The host tier's pages: runs, reuse, merging, and the tier's budget in whole pages."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.arena import Arena
from tokendance.backend.offload import HostTier
from tests.backend.test_offload import TOKEN, Slots, kv_of, make_cache

ROW = (3, 2, 2, 8)  # layers, K|V, Hkv, D
ROW_BYTES = 3 * 2 * 2 * 8 * 4


def arena(pages: int, page: int = 4) -> Arena:
    return Arena(ROW, torch.float32, pin=False, capacity=pages * page * ROW_BYTES, page=page)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, *ROW), generator=torch.Generator().manual_seed(seed))


def test_write_then_read_is_exact_across_runs():
    a = arena(pages=10)
    first = a.alloc(5)  # pages 0, 1 (the second one partly)
    a.release(a.alloc(2))  # page 2 used and freed: handed out again below
    whole = a.alloc(15)
    assert first.runs == [(0, 2)] and whole.runs == [(2, 4)]
    a.release(first)
    split = a.alloc(13)  # pages 0, 1 and 6, 7: two runs, two copies
    assert split.runs == [(0, 2), (6, 2)] and [v.shape[0] for v in a._views(split)] == [8, 5]
    want = {id(p): rows(p.n, i) for i, p in enumerate((whole, split))}
    for p in (whole, split):
        a.write(p, want[id(p)])
    for p in (whole, split):
        out = torch.empty_like(want[id(p)])
        a.read(p, out)
        assert torch.equal(out, want[id(p)])


def test_freed_pages_merge_back_and_a_full_arena_refuses():
    a = arena(pages=9)
    held = [a.alloc(n) for n in (3, 9, 1, 7, 4)]  # 1 + 3 + 1 + 2 + 1 pages
    assert a.free == [[8, 9]] and a.free_pages == 1
    with pytest.raises(MemoryError, match="2 pages asked, 1 of 9 free"):
        a.alloc(5)
    for i in (3, 0, 4, 1, 2):
        a.release(held[i])
    assert a.free == [[0, 9]] and a.free_pages == 9
    assert a.alloc(0).runs == [] and a.alloc(36).runs == [(0, 9)]


def test_a_budget_the_host_cannot_hold_is_one_clear_error():
    with pytest.raises(MemoryError, match="host tier: cannot allocate .* GiB of host memory"):
        Arena(ROW, torch.float32, pin=False, capacity=1 << 62)


def test_a_budget_under_one_page_is_one_clear_error():
    """It would hold nothing, silently."""
    with pytest.raises(ValueError, match=r"host tier: 767 bytes hold not one page \(768 bytes, 2 tokens"):
        Arena(ROW, torch.float32, pin=False, capacity=2 * ROW_BYTES - 1, page=2)
    assert arena(pages=0).capacity == 0  # none at all: the tier is off


def test_the_tier_holds_whole_pages():
    """With pages of 4 tokens, 5 private tokens hold 2 pages; the budget counts pages,
    so a tier of 4 pages fits two such agents, and a third evicts the first. A Master
that cannot fit beside a taken agent is not put."""
    cache = make_cache()
    tier = HostTier(cache, 4 * 4 * TOKEN, page=4)
    alloc = Slots(cache.num_blocks, 11)
    slots = {n: alloc.take(5) for n in "abc"}
    want = {n: kv_of(cache, s) for n, s in slots.items()}
    assert tier.park("a", slots["a"], []) == 2 * 4 * TOKEN
    assert tier.park("b", slots["b"], []) == 2 * 4 * TOKEN
    assert tier.park("c", slots["c"], []) == 2 * 4 * TOKEN
    assert "a" not in tier and tier.bytes == 4 * 4 * TOKEN
    tier.take("c")  # its next request restores it: it stays
    assert not tier.put_master(1, alloc.take(9))  # 3 pages: not even with b gone
    assert tier.put_master(2, alloc.take(8))  # 2 pages: b goes
    assert "b" not in tier and tier.bytes == 4 * 4 * TOKEN
    cache.kv.zero_()
    dst = alloc.take(5)
    tier.restore([("c", dst)], {})
    assert torch.equal(kv_of(cache, dst), want["c"])
    tier.release_master(2)
    assert tier.bytes == 0 and tier.arena.free == [[0, 4]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_pages_on_cuda_round_trip():
    """On CUDA the pages are pinned once and copies are queued: agents parked, restored
    and parked again come back bit-exact, in the same host buffer."""
    from types import SimpleNamespace

    from tokendance.backend.model import KVCache

    cfg = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=64)
    cache = KVCache(cfg, 256, 16, torch.bfloat16, "cuda")
    cache.kv.normal_()
    tier = HostTier(cache, 64 << 20, page=48)
    host = tier.arena.data
    assert host.is_pinned()
    g = torch.Generator().manual_seed(3)
    view = cache.kv.view(4, 2, -1, 2, 64)
    for rep in range(4):
        src = {f"a{i}": torch.randperm(256 * 16, generator=g)[:300 + 70 * i].cuda() for i in range(5)}
        want = {n: view[:, :, s].clone() for n, s in src.items()}
        for n, s in src.items():
            assert tier.park(n, s, []) > 0
        cache.kv.zero_()
        sizes = [len(s) for s in src.values()]  # destinations that do not overlap
        dst = dict(zip(src, torch.randperm(256 * 16, generator=g)[:sum(sizes)].cuda().split(sizes)))
        tier.restore(list(dst.items()), {})
        for n, d in dst.items():
            assert torch.equal(view[:, :, d], want[n])
        cache.kv.normal_()
        assert tier.arena.data is host and tier.bytes == 0
