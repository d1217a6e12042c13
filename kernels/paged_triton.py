"""Triton kernels of `paged_attention` (the definition and the CPU path live in
paged_attention.py): varlen prefill, flash-attention style, and split-K decode with a
reduce over the splits. Both read keys stored before RoPE through block tables and
rotate each K tile once per kv head while scoring it against that head's G query rows
(the tile loop is kernels/tiles.py's).
"""

from __future__ import annotations

import os

import torch

from tokendance.kernels.fp8 import is_fp8
from tokendance.kernels.tiles import LOG2E, _attend_ranges, _prep, _scratch

from tokendance.kernels.jit import (
    cols, fitting, head_strides, in_heads, launch_options, padded_half, tiles_head, tl, triton,
)


@triton.jit
def _prefill_kernel(q, q_pos, cu_q, kc, vc, bt, kpt, kv_lens, inv_freq, out,
                    s_qt, s_qh, s_blk, s_slot, s_kh, s_bt, s_sp, qk_scale, trig, trig_n, win, cap,
                    G: tl.constexpr, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
                    POS: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr, TRIG: tl.constexpr,
                    PREC: tl.constexpr):
    # Last row blocks first: under causality they carry the most keys.
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_lo = tl.load(cu_q + seq)
    n_rows = (tl.load(cu_q + seq + 1) - q_lo) * G
    if mb * BLOCK_M >= n_rows:
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < n_rows
    tok = (q_lo + rows // G).to(tl.int64)
    head = kvh * G + rows % G
    qp = tl.load(q_pos + tok, mask=valid, other=0).to(tl.int32)
    kv_len = tl.load(kv_lens + seq).to(tl.int32)
    hm = cols(HP, HALF, HP != HALF)
    offs_h = tl.arange(0, HP)
    qo = in_heads(tok[:, None], s_qt, HALF) + in_heads(head[:, None], s_qh, HALF) + offs_h[None, :]
    q1 = tl.load(q + qo, mask=valid[:, None] & hm[None, :], other=0.0)
    q2 = tl.load(q + qo + HALF, mask=valid[:, None] & hm[None, :], other=0.0)
    f = tl.load(inv_freq + offs_h, mask=hm, other=0.0)[:, None]
    # Keys below every row's position need no mask; the rest up to the highest do. In a
    # sliding window, keys before the lowest row's window are skipped and those before
    # the highest row's masked too: masked [lo, mid), unmasked [mid, full), masked [full, hi).
    lo = 0
    mid = 0
    if POS:  # slot order says nothing about positions: every tile is masked
        hi = kv_len
        full = 0
    else:
        p_hi = tl.max(tl.where(valid, qp, -1), 0)
        hi = tl.minimum(kv_len, p_hi + 1)
        p_lo = tl.min(tl.where(valid, qp, kv_len), 0)
        full = tl.minimum(kv_len, p_lo + 1) // BLOCK_N * BLOCK_N
        if WIN:
            lo = tl.maximum(p_lo - win + 1, 0) // BLOCK_N * BLOCK_N
            mid = tl.minimum(tl.maximum(tl.cdiv(p_hi - win + 1, BLOCK_N) * BLOCK_N, lo), full)
    acc = tl.zeros([BLOCK_M, 2 * HP], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kc += in_heads(kvh, s_kh, HALF)
    vc += in_heads(kvh, s_kh, HALF)
    bt += seq.to(tl.int64) * s_bt
    kpt += seq.to(tl.int64) * s_sp
    acc, m_i, l_i = _attend_ranges(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, lo, mid, full, hi,
                                   s_blk, s_slot, qk_scale, trig, trig_n, win, cap, B, HALF, HP, BLOCK_N,
                                   STEP, POS, POS, WIN, CAP, TRIG, PREC)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    offs_d = tl.arange(0, 2 * HP)
    oo = in_heads(tok[:, None], s_qt, HALF) + in_heads(head[:, None], s_qh, HALF) + offs_d[None, :]
    dm = cols(2 * HP, 2 * HALF, HP != HALF)
    tl.store(out + oo, o.to(out.dtype.element_ty), mask=valid[:, None] & dm[None, :])


@triton.jit
def _decode_kernel(q, q_pos, cu_q, kc, vc, bt, kpt, kv_lens, inv_freq, o_part, lse_part, n_total,
                   s_qt, s_qh, s_blk, s_slot, s_kh, s_bt, s_sp, qk_scale, trig, trig_n, win, cap,
                   G: tl.constexpr, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                   STEP: tl.constexpr, POS: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr,
                   TRIG: tl.constexpr, PREC: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    q_lo = tl.load(cu_q + seq)
    n_q = tl.load(cu_q + seq + 1) - q_lo  # 0 or 1
    has_q = n_q > 0
    rows = tl.arange(0, BLOCK_M)
    valid = rows < G * n_q
    head = kvh * G + rows
    p = tl.load(q_pos + q_lo, mask=has_q, other=0).to(tl.int32)
    kv_len = tl.load(kv_lens + seq).to(tl.int32)
    if POS:
        end = tl.where(has_q, kv_len, 0)
    else:
        end = tl.where(has_q, tl.minimum(kv_len, p + 1), 0)
    # Tile-aligned splits: no tile crosses into the next split's keys. In a sliding
    # window they split the window's keys, the first tile masked where it starts early.
    if WIN and not POS:
        first = tl.maximum(p - win + 1, 0)
        start = first // BLOCK_N * BLOCK_N
        span = tl.cdiv(tl.cdiv(tl.maximum(end - start, 0), NSPLIT), BLOCK_N) * BLOCK_N
        lo = start + sp * span
    else:
        span = tl.cdiv(tl.cdiv(end, NSPLIT), BLOCK_N) * BLOCK_N
        lo = sp * span
    hi = tl.minimum(lo + span, end)
    if POS:
        full = lo
    else:
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    mid = lo
    if WIN and not POS:
        mid = tl.minimum(tl.maximum(tl.cdiv(first, BLOCK_N) * BLOCK_N, lo), full)
    hm = cols(HP, HALF, HP != HALF)
    offs_h = tl.arange(0, HP)
    qo = in_heads(q_lo.to(tl.int64), s_qt, HALF) + in_heads(head[:, None], s_qh, HALF) + offs_h[None, :]
    q1 = tl.load(q + qo, mask=valid[:, None] & hm[None, :], other=0.0)
    q2 = tl.load(q + qo + HALF, mask=valid[:, None] & hm[None, :], other=0.0)
    qp = tl.zeros([BLOCK_M], dtype=tl.int32) + p
    f = tl.load(inv_freq + offs_h, mask=hm, other=0.0)[:, None]
    acc = tl.zeros([BLOCK_M, 2 * HP], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kc += in_heads(kvh, s_kh, HALF)
    vc += in_heads(kvh, s_kh, HALF)
    bt += seq.to(tl.int64) * s_bt
    kpt += seq.to(tl.int64) * s_sp
    acc, m_i, l_i = _attend_ranges(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, lo, mid, full, hi,
                                   s_blk, s_slot, qk_scale, trig, trig_n, win, cap, B, HALF, HP, BLOCK_N,
                                   STEP, POS, False, WIN, CAP, TRIG, PREC)
    # An empty split leaves weight 0 (lse = -inf) and a zero partial.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    base = (seq * (G * tl.num_programs(1)) + head) * n_total + sp
    offs_d = tl.arange(0, 2 * HP)
    dm = cols(2 * HP, 2 * HALF, HP != HALF)
    tl.store(o_part + base[:, None] * (2 * HALF) + offs_d[None, :],
             acc / l_safe[:, None], mask=valid[:, None] & dm[None, :])
    tl.store(lse_part + base, lse, mask=valid)


@triton.jit
def _reduce_kernel(o_part, lse_part, cu_q, chunks, out, n_total, n_own, s_qt, s_qh,
                   BLOCK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """One (sequence, head): its partials merged BLOCK at a time, rescaled as they come
    (a tile of every partial at once spilled registers past ~64 of them: with 256 Master
    chunks a step of ten Mirrors took twice as long)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    q_lo = tl.load(cu_q + seq)
    if tl.load(cu_q + seq + 1) == q_lo:
        return
    offs_d = tl.arange(0, DP)  # D columns, padded to a power of two
    dm = cols(DP, D, DP != D)
    row = (seq * tl.num_programs(1) + h) * n_total
    m = -1e30  # finite: a block of empty partials (-inf) then weighs exactly 0
    l = 0.0
    acc = tl.zeros([DP], dtype=tl.float32)
    for start in range(0, n_total, BLOCK):
        sp = start + tl.arange(0, BLOCK)
        used = sp < n_total
        # Partials from n_own on are Master chunks' (kernels/collective.py): an empty
        # chunk (padding) wrote none.
        ch = used & (sp >= n_own)
        c = tl.where(ch, sp - n_own, 0)
        lo = tl.load(chunks + c * 3, mask=ch, other=0)
        used = used & (tl.load(chunks + c * 3 + 1, mask=ch, other=1) > lo)
        # Some partials may be empty (-inf), never all: a query always sees its own key.
        lse = tl.load(lse_part + row + sp, mask=used, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        w = tl.exp2(lse - m_new)
        o = tl.load(o_part + (row + sp)[:, None] * D + offs_d[None, :], mask=used[:, None] & dm[None, :],
                    other=0.0)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    tl.store(out + in_heads(q_lo.to(tl.int64), s_qt, D // 2) + in_heads(h, s_qh, D // 2) + offs_d,
             (acc / l).to(out.dtype.element_ty), mask=dm)


# Launch configurations on a GPU, and the small tiles the interpreter runs faster with.
# Picked by bench/kernels.py on an H200 (Triton 3.6, Qwen2.5-7B shape, 32 x 4k decode):
# decode is bound by registers; rotating keys by rows of the cos/sin table (step="table")
# instead of carrying cos/sin across tiles takes it from 148 registers and spills to 104
# and none, 150 -> 127 us (2.11 TB/s); step=False (a sine and a cosine per element) cost
# 1.5x in decode, 1.7x in prefill.
PREFILL_CFG = dict(block_m=128, block_n=64, num_warps=8, num_stages=2, step=True)
DECODE_CFG = dict(block_n=32, num_warps=4, num_stages=2, step="table")
# Over an 8-bit pool the decode kernel took 141 registers a thread (104 over bf16) and 185.0
# us against bf16's 135.5 (H100, Triton 3.6, 32 x 4k, head dim 128; bench/fp8_decode.py):
# capped at 128 it keeps more warps resident, 156.4 us (96: 167.2, with spills). Reading
# Mirrors' slot positions, 199.2 us uncapped against 165.6; in a window of 1,024, 67.9
# against 60.1 (session 63). Capped scores and wider heads were not measured.
FP8_DECODE_CFG = dict(maxnreg=128)


def decode_cap(pool: torch.dtype, d: int, softcap: float = 0.0) -> dict:
    """The decode launch's options past DECODE_CFG for a pool of `pool` at head dim `d`
    (FP8_DECODE_CFG where it was measured to help, else none)."""
    return FP8_DECODE_CFG if is_fp8(pool) and d <= 128 and not softcap else {}


INTERP_CFG = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, step=True)
# Past head dim 128 the prefill's 128-tuned tiles spill registers (bench/ptx.py) and, in
# float32, ask for more shared memory than an H100 has (327,680 bytes at 256). On an H100,
# bf16, head dim 256: keys of 32 took 97.2 us against 181.2 (Gemma 3 1B's attention, 2,048
# rows after 2,048 keys in a window of 512, bench/windows.py (e); rows of 64 as well, 95.7),
# and a fresh prompt of Gemma 2 2B's heads, capped, 177.2 us against 321.1 at 2,048 tokens
# and 485.2 against 872.7 at 4,096 (rows of 64: 284.7 and 717.7).
WIDE_PREFILL_CFG = dict(PREFILL_CFG, block_n=32)
# Smaller tiles, in order, for a launch that asks for more shared memory than the GPU has
# (`jit.fitting`).
SMALLER = (dict(block_n=32), dict(block_m=64, block_n=32), dict(block_m=64, block_n=32, num_stages=1),
           dict(block_m=32, block_n=32, num_stages=1), dict(block_m=16, block_n=16, num_stages=1))


def _rotation(step: bool | str, pos: bool, trig: torch.Tensor | None) -> int:
    """The kernels' STEP for a launch configuration's `step`: True, rotate per tile;
    "table", read the cos/sin table (when there is one); False, sines and cosines."""
    if pos:
        return 0
    if step == "table":
        return 2 if trig is not None else 1
    return int(bool(step))


def decode_splits(dev: torch.device, work: int, per_sm: int = 8) -> int:
    """Splits per (sequence, kv head): about `per_sm` programs per SM in all, at most 32
    (on an H200, Qwen2.5-7B shape, one 2.4 k-token sequence's decode step took 4.91 ms
    with 32 splits, 5.00 with 16; 64 did no better)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    return min(32, triton.next_power_of_2(max(1, per_sm * sms // max(work, 1))))


def paged_attention_triton(
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
    *,
    max_q: int | None = None,
    num_splits: int | None = None,
    cfg: dict | None = None,
    out: torch.Tensor | None = None,
    trig: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The Triton path of `paged_attention`: the decode kernel when no sequence has
    more than one query, the prefill kernel otherwise.

    slot_pos, window, softcap: see `paged_attention`. max_q: the most queries of one sequence, when
    the caller knows it (else one host sync reads it from cu_q). cfg overrides the launch
    configuration; out, a contiguous [T, Hq, D] tensor, receives the result. trig: see
    `tiles.trig_table`, for slots at scattered positions.
    """
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("paged_attention_triton needs CUDA tensors (or TRITON_INTERPRET=1)")
    T, Hq, D = q.shape
    Hkv, B = k_cache.shape[2], k_cache.shape[1]
    S = kv_lens.shape[0]
    if not tiles_head(D):
        raise ValueError(f"head dim {D} must be even, 16 to 256 (paged_attention takes any)")
    assert Hq % Hkv == 0, (Hq, Hkv)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.is_contiguous()
    if T == 0:
        return out
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_q == 1:
        ns = num_splits or decode_splits(q.device, S * Hkv)
        o_part = _scratch(S, Hq, ns, D, device=q.device)
        lse = _scratch(S, Hq, ns, device=q.device)
        decode_partials(q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                        rope_scale, sm_scale, slot_pos, o_part, lse, ns, cfg, trig, window, softcap)
        reduce_partials(o_part, lse, cu_q, out)
        return out
    G = Hq // Hkv
    interp = not q.is_cuda
    prec, common, kpt, inv_freq, block_tables = _prep(q, k_cache, block_tables, kv_lens, inv_freq,
                                                      rope_scale, sm_scale, slot_pos, trig)
    pos_flag = slot_pos is not None
    c = {**(INTERP_CFG if interp else PREFILL_CFG if D <= 128 else WIDE_PREFILL_CFG), **(cfg or {})}

    def launch(c: dict) -> None:
        _prefill_kernel[(triton.cdiv(max_q * G, c["block_m"]), S, Hkv)](
            q, q_pos, cu_q, k_cache, v_cache, block_tables, kpt, kv_lens, inv_freq, out,
            q.stride(0), q.stride(1), *common, window, softcap * LOG2E,
            G=G, B=B, HALF=D // 2, HP=padded_half(D), BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
            STEP=_rotation(c["step"], pos_flag, trig), POS=pos_flag, WIN=window > 0, CAP=softcap > 0,
            TRIG=trig is not None, PREC=prec, **launch_options(c))

    fitting(("prefill", q.device, q.dtype, k_cache.dtype, D, G, B, pos_flag, window > 0, softcap > 0,
             trig is not None), c, SMALLER, launch)
    return out


def decode_partials(q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens, inv_freq,
                    rope_scale: float, sm_scale: float, slot_pos, o_part: torch.Tensor,
                    lse_part: torch.Tensor, num_splits: int | None = None,
                    cfg: dict | None = None, trig: torch.Tensor | None = None,
                    window: int = 0, softcap: float = 0.0) -> int:
    """Split-K decode (one query per sequence, q contiguous) into partial slots
    0 .. ns-1 of o_part [S, Hq, n, D] / lse_part [S, Hq, n] (log2); returns ns, at most n
    (the caller may fill the slots after them, see kernels/collective.py)."""
    S, Hq, n, D = o_part.shape
    Hkv, B = k_cache.shape[2], k_cache.shape[1]
    ns = min(n, num_splits or decode_splits(q.device, S * Hkv))
    prec, common, kpt, inv_freq, block_tables = _prep(q, k_cache, block_tables, kv_lens, inv_freq,
                                                      rope_scale, sm_scale, slot_pos, trig)
    pos_flag = slot_pos is not None
    cap = decode_cap(k_cache.dtype, D, softcap) if q.is_cuda else {}
    c = {**(DECODE_CFG if q.is_cuda else INTERP_CFG), **cap, **(cfg or {})}

    def launch(c: dict) -> None:
        _decode_kernel[(S, Hkv, ns)](
            q, q_pos, cu_q, k_cache, v_cache, block_tables, kpt, kv_lens, inv_freq, o_part, lse_part, n,
            q.stride(0), q.stride(1), *common, window, softcap * LOG2E,
            G=Hq // Hkv, B=B, HALF=D // 2, HP=padded_half(D), BLOCK_M=max(16, triton.next_power_of_2(Hq // Hkv)),
            BLOCK_N=c["block_n"], NSPLIT=ns, STEP=_rotation(c["step"], pos_flag, trig), POS=pos_flag,
            WIN=window > 0, CAP=softcap > 0, TRIG=trig is not None, PREC=prec, **launch_options(c))

    fitting(("decode", q.device, q.dtype, k_cache.dtype, D, Hq // Hkv, B, pos_flag, window > 0,
             softcap > 0, trig is not None), c, (dict(num_stages=1), dict(block_n=16, num_stages=1)), launch)
    return ns


REDUCE_BLOCK = 32  # partials merged per iteration of the reduce


def reduce_partials(o_part: torch.Tensor, lse_part: torch.Tensor, cu_q: torch.Tensor,
                    out: torch.Tensor, chunks: torch.Tensor | None = None) -> None:
    """Merge every sequence's partials (o_part [S, Hq, n, D], log2 lse [S, Hq, n]) into
    out [T, Hq, D] at its query row. With `chunks` (a MasterRead's), the last
    len(chunks) partials are the Master chunks', and empty chunks' are skipped."""
    S, Hq, n, D = o_part.shape
    n_own = n if chunks is None else n - chunks.shape[0]
    assert head_strides(D, *out.stride()[:2])
    _reduce_kernel[(S, Hq)](o_part, lse_part, cu_q, cu_q if chunks is None else chunks, out, n,
                            n_own, out.stride(0), out.stride(1),
                            BLOCK=min(REDUCE_BLOCK, triton.next_power_of_2(n)), D=D,
                            DP=2 * padded_half(D), num_warps=4)
