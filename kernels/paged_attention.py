"""Paged attention with RoPE on read.

One function, two implementations: `paged_attention_reference` in plain torch (the
definition, and the CPU path) and Triton kernels (the CUDA path). Both read keys
stored *before* RoPE from a paged pool and rotate each key by its logical position
while reading it.

Layout of one layer's pool: k_cache, v_cache [num_blocks, B, Hkv, D], in the queries'
dtype, or in 8 bits (kernels/fp8.py) and cast up to it on read. Sequence s owns
key slots 0 .. kv_lens[s]-1; slot j lives in physical block block_tables[s, j // B] at
offset j % B, and its logical position is j, or slot_pos[s, j] when a slot-position
table is given (a negative one hides the slot). That table lets one sequence read
another's blocks at other positions, and skip slots: a Mirror reads the round's Master
blocks at its own offsets, minus the tokens it recomputed privately. Queries of
sequence s are rows cu_q[s] .. cu_q[s+1]-1 of q, already rotated at q_pos; a query at
position p attends to the visible keys at positions <= p (prefill, chunked prefill and
decode are the same call).

The kernels treat the Hq/Hkv query heads that share a kv head as extra query rows
(row r = token r // G, head r % G), so each K/V tile is loaded and rotated once per
group. Prefill: one program per (row block, sequence, kv head), flash-attention style.
Decode (one query per sequence): split-K, several programs per (sequence, kv head) over
disjoint key ranges, then a reduce over the splits. A decode step over Mirrors can take
the batch's Master apart (`master`, kernels/master.py): the sequences' tables then hold
their own blocks only, the collective kernel reads the Master once for all of them, and
the reduce merges both parts (`master_decode_reference` / `master_decode_triton`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tokendance.kernels.collective import master_attention_reference
from tokendance.kernels.collective_triton import collective_partials
from tokendance.kernels.fp8 import widen
from tokendance.kernels.jit import tiles_head
from tokendance.kernels.master import MasterRead
from tokendance.kernels.merge import merge_attention
from tokendance.kernels.paged_triton import (decode_partials, decode_splits, paged_attention_triton,
                                             reduce_partials)
from tokendance.kernels.rope import rope_apply, rope_cos_sin
from tokendance.kernels.rotated import gathered, rotated_decode
from tokendance.kernels.runs import FLASH_LSE, Rows, runs_attention, split_rows
from tokendance.kernels.softcap import cap_scores, sdpa
from tokendance.kernels.tiles import _scratch


def kv_slots(block_table: torch.Tensor, kv_len: int, bsz: int) -> torch.Tensor:
    """The flat pool slots (block * bsz + offset) of one sequence's first kv_len tokens."""
    nblocks = (kv_len + bsz - 1) // bsz
    offsets = torch.arange(bsz, device=block_table.device)
    return (block_table[:nblocks].long()[:, None] * bsz + offsets).flatten()[:kv_len]


def paged_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
    slot_pos: torch.Tensor | None = None,
    plan: dict | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention output [T, Hq, D] in q.dtype. slot_pos: [S, >= slots in the tables]
    positions of the table slots, or None for slot j at position j. plan: a dict the
    layers of one step share (AttnMeta.plan): decode and prefill work out how each
    sequence reads the pool once in it. window, softcap: see `paged_attention`."""
    starts = cu_q.tolist()
    if starts[-1] == len(starts) - 1:  # one query per sequence
        return _decode_reference(q, q_pos, k_cache, v_cache, block_tables, kv_lens,
                                 inv_freq, rope_scale, sm_scale, slot_pos, plan=plan, window=window,
                                 softcap=softcap)
    out = torch.empty_like(q)
    for s, kv_len in enumerate(kv_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        # a model's NoPE layers read with other angles, its sliding-window ones fewer keys
        key = ("prefill", s, inv_freq.data_ptr(), window, softcap)
        read = plan.get(key) if plan is not None else None
        if read is None:
            read = _seq_read(q, q_pos[lo:hi].long(), block_tables[s], kv_len, k_cache.shape[1],
                             None if slot_pos is None else slot_pos[s], inv_freq, rope_scale, window,
                             runs=not softcap)
            if plan is not None:
                plan[key] = read
        # One gather of the slots each, the keys then rotated where they landed.
        k = widen(k_cache.flatten(0, 1).index_select(0, read.slots), q.dtype)
        v = widen(v_cache.flatten(0, 1).index_select(0, read.slots), q.dtype)
        k = rope_apply(k, read.cos, read.sin, inplace=True)
        if read.rows is not None:
            out[lo:hi] = runs_attention(q[lo:hi], k, v, read.rows, sm_scale)
        else:
            out[lo:hi] = _masked_attention(q[lo:hi], read.qp, k, v, read.kpos, sm_scale, window, softcap)
    return out


@dataclass(slots=True)
class _SeqRead:
    """How one sequence's prefill rows read the pool: the same in every layer of a step."""

    slots: torch.Tensor  # pool slots of its visible keys, in position order
    kpos: torch.Tensor  # their positions
    cos: torch.Tensor  # RoPE of kpos [L, 1, D/2]
    sin: torch.Tensor
    qp: torch.Tensor  # the rows' positions
    rows: Rows | None  # keys at 0 .. L-1 on CPU: runs and rest (kernels/runs.py); else one masked call


def _seq_read(q, qp, block_table, kv_len: int, bsz: int, slot_pos, inv_freq, rope_scale,
              window: int = 0, runs: bool = True) -> _SeqRead:
    """`runs`: the CPU's flash calls may serve (not for capped scores)."""
    slots = kv_slots(block_table, kv_len, bsz)
    kpos = torch.arange(kv_len, device=q.device)
    if slot_pos is not None:
        # Hidden slots (which may hold anything) dropped, the rest in position order: a
        # Mirror's keys are then positions 0 .. P, as a plain sequence's are.
        kpos = slot_pos[:kv_len].long()
        keep = torch.nonzero((kpos >= 0) & (kpos <= qp.max())).flatten()
        keep = keep[kpos[keep].argsort()]
        slots, kpos = slots[keep], kpos[keep]
    slides = bool(window) and int(qp.max()) >= window  # some row's window leaves keys out
    if slides:  # keys before every row's window are not read
        keep = kpos > int(qp.min()) - window
        slots, kpos = slots[keep], kpos[keep]
    rows = None
    if (runs and len(qp) > 1 and FLASH_LSE is not None and not q.is_cuda and not slides
            and torch.equal(kpos, torch.arange(len(kpos), device=kpos.device))):
        rows = split_rows(qp, q.dtype)
    cos, sin = rope_cos_sin(kpos, inv_freq, rope_scale)
    return _SeqRead(slots, kpos, cos[:, None, :], sin[:, None, :], qp, rows)


def _masked_attention(q: torch.Tensor, qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kpos: torch.Tensor, sm_scale: float, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """Queries at positions qp over rotated keys at kpos, each seeing kpos <= its own
    (and > its own - window, with one): one SDPA call with a mask (none for one query at or
    past the last key, with no window), scores capped at softcap (0: none)."""
    mask = None
    if window or not (len(qp) == 1 and int(qp[0]) >= int(kpos.max())):
        mask = kpos[None, :] <= qp[:, None]
        if window:
            mask &= kpos[None, :] > qp[:, None] - window
    # 4-D inputs: on CPU this takes SDPA's fused path, 3-D ones the slow math path.
    o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1).to(q.dtype)[None], v.transpose(0, 1)[None],
             sm_scale, softcap, mask=mask)
    return o[0].transpose(0, 1)


def _decode_layout(q_pos, block_tables, kv_lens, inv_freq, rope_scale, slot_pos, bsz: int,
                   nblocks: int, window: int = 0) -> tuple:
    """What every layer of a decode step reads the same way: pool slots to gather (S x L,
    flat), L, the keys' cos and sin [S or 1, L, 1, D/2], an additive mask [S, L]: -inf for
    the keys a query does not see, and the keys' positions [S or 1, L]. In a sliding window
    the slots before every query's window are left out (they are in position order)."""
    s = kv_lens.shape[0]
    end = int(kv_lens.max())
    first = max(0, int(q_pos.min()) - window + 1) if window and slot_pos is None else 0
    blocks = block_tables[:, : -(-end // bsz)].long().clamp(0, nblocks - 1)
    kpos = torch.arange(first, end, device=kv_lens.device)
    width = end - first
    live = kpos[None, :] < kv_lens[:, None]
    idx = blocks.gather(1, (kpos // bsz).expand(s, -1)) * bsz + kpos % bsz  # [S, L] pool slots
    if slot_pos is not None:
        kpos = slot_pos[:, :width].long()  # [S, L]
        live &= kpos >= 0
    # Padding and hidden slots may hold anything (NaN would survive a zero weight): read a
    # live slot of the same sequence in their place; the mask drops them.
    idx = torch.where(live, idx, idx.gather(1, live.to(torch.uint8).argmax(1, keepdim=True)))
    cos, sin = rope_cos_sin(kpos.clamp_min(0).flatten(), inv_freq, rope_scale)
    rows = s if slot_pos is not None else 1  # else the same positions for every sequence
    visible = live & (kpos <= q_pos[:, None])
    if window:
        visible &= kpos > q_pos[:, None] - window
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    mask.masked_fill_(~visible, float("-inf"))
    return (idx.flatten(), width, cos.view(rows, width, 1, -1), sin.view(rows, width, 1, -1), mask,
            kpos.view(rows, width))


def _decode_reference(q, q_pos, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                      rope_scale, sm_scale, slot_pos=None, lse: bool = False, plan: dict | None = None,
                      window: int = 0, softcap: float = 0.0):
    """One query per sequence: every sequence's keys gathered into one padded batch
    [S, L, Hkv, D] in float32, rotated where they landed, then per kv head two batched
    matmuls that read K and V in that layout (a dozen small ops per sequence per layer in
    a loop, CPU SDPA with a mask, and transposing K/V to heads-first all cost more than
    the attention itself: on 2 cores, 8 x 288 keys of SmolLM2, 1.22 ms a layer with the
    transposes, 0.72 without). With `lse`: (o, natural-log lse [S, Hq]) in float32, for
    merging with another key set. `plan` keeps the layout for the step's other layers;
    with a `RotatedStep` under "rotated" in it, the layer attends over the keys it held
    since the last step (kernels/rotated.py)."""
    s, hkv, d = q.shape[0], k_cache.shape[2], q.shape[-1]

    def layout() -> tuple:
        key = ("decode", inv_freq.data_ptr(), window)
        got = plan.get(key) if plan is not None else None
        if got is None:
            got = _decode_layout(q_pos, block_tables, kv_lens, inv_freq, rope_scale, slot_pos,
                                 k_cache.shape[1], k_cache.shape[0], window)
            if plan is not None:
                plan[key] = got
        return got

    step = plan.get("rotated") if plan is not None and not lse else None
    if step is not None:
        o = rotated_decode(step, q, k_cache, v_cache, layout, inv_freq, rope_scale, sm_scale, window,
                           softcap)
        if o is not None:
            return o
    got = layout()
    k, v = gathered(k_cache, v_cache, got, s)
    v, mask = v.float(), got[4]
    qg = q.float().view(s, hkv, -1, d)  # [S, Hkv, G, D]
    o = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    lses = torch.empty(qg.shape[:-1], dtype=torch.float32, device=q.device) if lse else None
    for h in range(hkv):
        if softcap:
            scores = cap_scores(torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).mul_(sm_scale), softcap)
            scores += mask[:, None, :]
        else:
            scores = torch.baddbmm(mask[:, None, :], qg[:, h], k[:, :, h].transpose(1, 2), alpha=sm_scale)
        torch.bmm(scores.softmax(-1), v[:, :, h], out=o[:, h])  # [S, G, D]
        if lse:
            lses[:, h] = torch.logsumexp(scores, -1)
    if lse:
        return o.view(q.shape), lses.view(q.shape[:2])
    return o.view(q.shape).to(q.dtype)


def master_decode_reference(q, q_pos, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                            rope_scale, sm_scale, slot_pos, read: MasterRead, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """Decode over each sequence's own keys and the batch's Master (kernels/master.py):
    the two parts computed apart and merged by their lse."""
    o1, lse1 = _decode_reference(q, q_pos, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                                 rope_scale, sm_scale, slot_pos, lse=True, window=window, softcap=softcap)
    o2, lse2 = master_attention_reference(q, q_pos, k_cache, v_cache, read, inv_freq, rope_scale,
                                          sm_scale, window, softcap)
    return merge_attention(o1, lse1, o2, lse2)[0].to(q.dtype)


def master_decode_triton(q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                         rope_scale: float, sm_scale: float, slot_pos, read: MasterRead,
                         out: torch.Tensor | None = None, trig: torch.Tensor | None = None,
                         window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode (one query per sequence) over each sequence's own keys (block_tables,
    kv_lens, slot_pos as in paged attention) and the batch's Master (read), the Master
    read collectively: both write partials into one buffer, one reduce merges them."""
    S, Hq, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    # Fewer splits for the own parts (history, patches, tail: short) than for a plain
    # batch: on an H200 (Qwen2.5-7B shape, CUDA graphs of 16 and 32 rows) 10 and 20
    # Mirrors stepped in 5.71 and 6.39 ms with 8 and 4 splits, 5.75 and 6.46 with 16.
    ns = decode_splits(q.device, S * k_cache.shape[2], per_sm=4)
    n = ns + read.chunks.shape[0]
    o_part = _scratch(S, Hq, n, D, device=q.device)
    lse_part = _scratch(S, Hq, n, device=q.device)
    # The two launches fill disjoint partial slots and are each too small to fill the GPU
    # at a decode batch: on CUDA the collective one runs on a side stream beside the
    # other (a fork and join that CUDA graphs capture), the reduce waits for both.
    side = _side_stream(q.device) if q.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        collective_partials(q, q_pos, k_cache, v_cache, read, inv_freq, rope_scale, sm_scale,
                            o_part, lse_part, ns, trig=trig, window=window, softcap=softcap)
    decode_partials(q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens, inv_freq, rope_scale,
                    sm_scale, slot_pos, o_part, lse_part, ns, trig=trig, window=window, softcap=softcap)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    reduce_partials(o_part, lse_part, cu_q, out, read.chunks)
    return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def paged_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
    max_q: int | None = None,
    slot_pos: torch.Tensor | None = None,
    master: MasterRead | None = None,
    trig: torch.Tensor | None = None,
    plan: dict | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Dispatch: the Triton kernels on CUDA (head dims they tile), the reference
    elsewhere. max_q (the most queries of one sequence) spares the GPU path a host sync.
    `master` (decode steps only): the batch's Master keys besides each sequence's own,
    read collectively. `trig` (kernels/paged_triton.py's trig_table) spares the kernels
    sines and cosines; `plan`, a dict shared by one step's layers, the reference its
    per-layer layout work. `window` (0: none): a sliding window, a query at p sees only
    the keys at p - window + 1 .. p (HF's sliding_window). `softcap` (0: none): each score
    s becomes softcap * tanh(s / softcap) before the mask and softmax (Gemma 2's
    attn_logit_softcapping)."""
    args = (q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens, inv_freq, rope_scale,
            sm_scale, slot_pos)
    triton = q.is_cuda and tiles_head(q.shape[-1])
    if master is not None:
        if triton:
            return master_decode_triton(*args, master, trig=trig, window=window, softcap=softcap)
        return master_decode_reference(q, q_pos, *args[3:], master, window, softcap)
    if triton:
        return paged_attention_triton(*args, max_q=max_q, trig=trig, window=window, softcap=softcap)
    return paged_attention_reference(*args, plan=plan, window=window, softcap=softcap)
