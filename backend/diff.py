"""Diff encode: a dense sequence becomes a Mirror of the bases its K/V equal.

A reader (`--bases reader`, backend/collector.py) is prefilled in full and holds its
whole prompt densely, though the round's Master holds copies of its shared segments:
those it gave, bit for bit, and the others' (computed in the other reader's context).
Token by token and view by view (kernels/diff.py), a reused token whose K/V equal the
Master's in every layer needs no private slot; one that differs only from the check
layer on keeps a patch; one that differs before it stays private. Nothing is
approximated: every layer reads the same values as before, from the Master's slots,
so the reader's answer stays exact.
"""

from __future__ import annotations

import torch

from tokendance.backend.blocks import BlockManager
from tokendance.backend.mirror import Mirror, Span
from tokendance.backend.model import KVCache
from tokendance.backend.parallel import Shard
from tokendance.backend.pool import flat_slots
from tokendance.backend.sequence import Sequence
from tokendance.kernels.diff import kv_diff


def encode(seq: Sequence, spans: list[Span], cache: KVCache, blocks: BlockManager,
           check_layer: int, tp: Shard | None = None) -> int:
    """Make dense seq (its prompt computed) a Mirror of `spans` where its K/V equal
    theirs; returns the private slots this frees (0: seq stays dense). With tensor
    parallelism a token is equal where it is on every rank. With a check
    layer past 1 every reused token keeps a private slot (mirror.py), so nothing is freed
    and nothing is done; nor for a sequence with generated tokens (a preempted one
    prefilled again), which stays dense."""
    assert seq.mirror is None, "a dense sequence"
    n = len(seq.prompt)
    spans = [sp for sp in spans if sp.lo + sp.n <= n]
    if check_layer != 1 or not spans or seq.out:
        return 0
    b = cache.block_size
    tok = torch.cat([torch.arange(sp.lo, sp.lo + sp.n) for sp in spans])
    base = torch.cat([flat_slots(sp.blocks, torch.arange(sp.n), b) for sp in spans])
    early, late = kv_diff(cache.kv, flat_slots(seq.blocks, tok, b), base, check_layer)
    if tp is not None:
        early, late = tp.max(early), tp.max(late)
    early, late = early.cpu(), late.cpu()
    reused = torch.zeros(n, dtype=torch.bool)
    reused[tok] = early == 0
    reused[-1] = False  # the last prompt token keeps its own slot, as in every Mirror
    patches = tok[reused[tok] & (late != 0)]
    if not bool((reused[tok] & (late == 0)).any()):
        return 0  # every reused token would be a patch: the same slots, moved
    spans = [sp for sp in spans if bool(reused[sp.lo:sp.lo + sp.n].any())]
    m = Mirror.build(n, spans, reused.tolist(), dense_early=False, patch_cap=len(patches))
    m.pick(patches.tolist())
    dense = seq.blocks
    seq.blocks, seq.mirror = [], m
    if not blocks.reserve(seq, n):
        seq.blocks, seq.mirror = dense, None
        return 0
    own = torch.nonzero(m.own_of >= 0).flatten()
    cache.copy(flat_slots(dense, own, b), flat_slots(seq.blocks, m.own_of[own], b))
    for blk in dense:
        blocks.pool.decref(blk)
    for blk in m.master_blocks:
        blocks.pool.incref(blk)
    return n - m.held(n)
