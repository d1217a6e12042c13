"""Diff encode: a dense sequence becomes a Mirror of the Master where its K/V equal it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.blocks import BlockManager
from tokendance.backend.detok import Detok
from tokendance.backend.diff import encode
from tokendance.backend.mirror import EARLY, LATE, Span
from tokendance.backend.model import KVCache
from tokendance.backend.pool import BlockPool, flat_slots
from tokendance.backend.sequence import Sequence

B, LAYERS, N = 4, 3, 40


def _setup(blocks: int = 40):
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=2, head_dim=8)
    cache = KVCache(cfg, blocks, B, torch.float32, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    mgr = BlockManager(BlockPool(blocks), B)
    seq = Sequence("reader", list(range(N)), SamplingParams(), Detok(None))
    assert mgr.reserve(seq, N)
    seq.computed = N
    return cache, mgr, seq


def _master(cache, mgr, seq, lo, n) -> Span:
    """A Master entry holding copies of seq's K/V at lo .. lo + n."""
    holder = Sequence("base", [0] * n, SamplingParams(), Detok(None))
    assert mgr.reserve(holder, n)
    rows = torch.arange(n)
    cache.copy(flat_slots(seq.blocks, rows + lo, B), flat_slots(holder.blocks, rows, B))
    return Span(holder.blocks, lo, n)


def _values(cache, seq, view_of_layer) -> list[torch.Tensor]:
    rows = torch.arange(N)
    flat = cache.kv.flatten(2, 3)
    return [flat[layer, :, seq.read_slots(rows, view_of_layer(layer), B)].clone() for layer in range(LAYERS)]


def test_encode_shares_what_equals_and_keeps_the_rest():
    cache, mgr, seq = _setup()
    dense = _values(cache, seq, lambda layer: EARLY)
    a = _master(cache, mgr, seq, 5, 16)  # equal in every layer: all of it shared
    b = _master(cache, mgr, seq, 24, 16)  # holds the last prompt token (39): private
    flat = cache.kv.flatten(2, 3)
    b_slot = flat_slots(b.blocks, torch.arange(16), B)
    flat[2, 1, b_slot[1]] += 1.0  # token 25 differs in a late layer's V: a patch
    flat[0, 0, b_slot[6]] += 1.0  # token 30 differs in layer 0's K: private in both views
    free_before = mgr.pool.num_free
    dense_blocks = list(seq.blocks)
    freed = encode(seq, [a, b], cache, mgr, check_layer=1)
    m = seq.mirror
    assert m is not None
    reused = set(range(5, 21)) | (set(range(24, 39)) - {30})
    assert set(torch.nonzero(m.reused).flatten().tolist()) == reused
    own_late = m.own_index(LATE, torch.arange(N))
    own_early = m.own_index(EARLY, torch.arange(N))
    assert {j for j in reused if own_late[j] >= 0} == {25}  # the one patch
    assert all(own_early[j] < 0 for j in reused)
    private = N - len(reused)
    assert freed == N - m.held(N) == len(reused) - 1 and m.held(N) == private + 1
    # Every layer reads what the dense sequence held (early view in layer 0, late after).
    assert all(torch.equal(x, y) for x, y in zip(_values(cache, seq, lambda layer: min(layer, 1)), dense))
    # The dense blocks went back; the Mirror holds its own and one reference per Master block.
    assert not set(dense_blocks) & set(seq.blocks)
    assert mgr.pool.num_free == free_before + len(dense_blocks) - len(seq.blocks)
    assert all(mgr.pool.refs[blk] == 2 for blk in a.blocks + b.blocks)


def test_encode_leaves_a_sequence_dense_when_nothing_is_gained():
    cache, mgr, seq = _setup()
    span = _master(cache, mgr, seq, 8, 12)
    assert encode(seq, [span], cache, mgr, check_layer=2) == 0 and seq.mirror is None  # every token keeps a slot
    flat = cache.kv.flatten(2, 3)
    flat[LAYERS - 1, 0, flat_slots(span.blocks, torch.arange(12), B)] += 1.0  # every token differs late
    blocks = list(seq.blocks)
    assert encode(seq, [span], cache, mgr, check_layer=1) == 0
    assert seq.mirror is None and seq.blocks == blocks
    cache, mgr, seq = _setup()
    span = _master(cache, mgr, seq, 8, 12)
    seq.out = [7]  # preempted after a token, prefilled again: left dense
    assert encode(seq, [span], cache, mgr, check_layer=1) == 0 and seq.mirror is None
    seq.out = []
    assert encode(seq, [span], cache, mgr, check_layer=1) > 0


def test_encode_without_room_keeps_the_dense_copy():
    cache, mgr, seq = _setup(blocks=14)  # 10 for the sequence, 3 for the Master, 1 free
    span = _master(cache, mgr, seq, 4, 12)
    blocks = list(seq.blocks)
    dense = _values(cache, seq, lambda layer: EARLY)
    assert encode(seq, [span], cache, mgr, check_layer=1) == 0
    assert seq.mirror is None and seq.blocks == blocks and mgr.pool.num_free == 1
    assert all(torch.equal(x, y) for x, y in zip(_values(cache, seq, lambda layer: EARLY), dense))
