"""Triton building blocks of the paged-attention kernels (kernels/paged_triton.py) and
the collective one (kernels/collective.py): one K/V tile into an online softmax with
RoPE on read, the loop over a key range, and the host-side argument preparation.

A head of D = 2 * HALF columns is tiled as two halves of HP columns each (a power of
two, `jit.padded_half`), and values and outputs as 2 * HP. Where HP > HALF the tile's
columns past the head's read columns of the head again (`jit.wrapped`): a query's
padding is zero, so they add nothing to a score, and the output's padding is never
stored (the kernels mask their queries' loads and their stores). Masks on every key and
value load instead took the decode kernel from 168 registers to 234 (ptxas for sm_90,
bench/ptx.py, compiled then without the launcher's specialization). With HP = HALF the
offsets are the plain ones."""

from __future__ import annotations

import torch

from tokendance.kernels.jit import head_strides, tl, triton, wrapped

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    if PREC == "upcast":  # the interpreter would multiply bf16 bit patterns as integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _cap(qk, cap):
    """cap * tanh(qk / cap), both in the log2 domain (cap = softcap * log2 e), as
    1 - 2 / (e^2x + 1): finite at any finite score, +-cap at the extremes."""
    e = tl.exp2(qk * (2.8853900817779268 / cap))  # e^(2 qk / cap): 2.885... = 2 log2 e
    return cap - 2.0 * cap / (e + 1.0)


@triton.jit
def _values_at(vc, row, offs_d):
    """Where a tile's values lie, slots `row` by columns `offs_d`: [BLOCK_N, D], or, in an
    8-bit pool, V^T [D, BLOCK_N]. The product with the scores wants each thread to hold
    pairs of slots; a tile of slots in 8 bits would be gathered byte by byte from shared
    memory (PTX: ld.shared.b8), a transposed one is widened in registers first."""
    if vc.dtype.element_ty.is_fp8():
        vp = vc + row[None, :] + offs_d[:, None]
    else:
        vp = vc + row[:, None] + offs_d[None, :]
    return vp


@triton.jit
def _values(vp, jm, dtype: tl.constexpr, MASK: tl.constexpr):
    """The values at `_values_at`'s vp [BLOCK_N, D] (slots past the live ones masked with
    MASK: they may be garbage), in `dtype`; an 8-bit pool's beside 16-bit rows in float16,
    which holds either format exactly and takes two values a conversion instruction."""
    if vp.dtype.element_ty.is_fp8():
        wide: tl.constexpr = tl.float32 if dtype == tl.float32 else tl.float16
        if MASK:
            v = tl.trans(tl.load(vp, mask=jm[None, :], other=0.0).to(wide))
        else:
            v = tl.trans(tl.load(vp).to(wide))
    else:
        if MASK:
            v = tl.load(vp, mask=jm[:, None], other=0.0).to(dtype)
        else:
            v = tl.load(vp).to(dtype)
    return v


@triton.jit
def _tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, j, jm, kpos, c, s, s_blk, s_slot, qk_scale,
          win, cap, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, MASK: tl.constexpr,
          POS: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr, PREC: tl.constexpr):
    """One key tile (slots j, live where jm, at positions kpos, rotated by c/s) into the
    online softmax of the rows (q1 | q2); with WIN a row at p sees only keys past p - win;
    with CAP scores are capped (`_cap`) before the mask. Keys are read in float32, values
    in the rows' dtype (a pool may hold 8-bit floats, kernels/fp8.py: `_values`)."""
    offs_h = wrapped(HP, HALF, HP != HALF)
    offs_d = wrapped(2 * HP, 2 * HALF, HP != HALF)
    if MASK:
        blk = tl.load(bt + j // B, mask=jm, other=0)
    else:
        blk = tl.load(bt + j // B)
    row = blk.to(tl.int64) * s_blk + (j % B) * s_slot
    kp = kc + row[None, :] + offs_h[:, None]  # K^T halves, [HP, BLOCK_N]
    vp = _values_at(vc, row, offs_d)
    if MASK:
        k1 = tl.load(kp, mask=jm[None, :], other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=jm[None, :], other=0.0).to(tl.float32)
    else:
        k1 = tl.load(kp).to(tl.float32)
        k2 = tl.load(kp + HALF).to(tl.float32)
    v = _values(vp, jm, q1.dtype, MASK)
    r1 = (k1 * c - k2 * s).to(q1.dtype)
    r2 = (k2 * c + k1 * s).to(q1.dtype)
    qk = _dot(q2, r2, _dot(q1, r1, None, PREC), PREC) * qk_scale
    if CAP:
        qk = _cap(qk, cap)
    if MASK:
        ok = jm[None, :] & (kpos[None, :] <= qp[:, None])
        if WIN:
            ok = ok & (kpos[None, :] > qp[:, None] - win)
        qk = tl.where(ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if POS or WIN:  # a row may have seen no visible key yet: keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PREC)
    return acc, m_new, l_i


@triton.jit
def _pos_tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, f, j, jm, kpos, ct, st, s_blk, s_slot,
              qk_scale, trig, trig_n, win, cap, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
              BLOCK_N: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr, TRIG: tl.constexpr,
              PREC: tl.constexpr):
    """A tile read through slot positions, rotated by rows of the cos/sin table `trig`
    ([2, trig_n, HALF] float32) with TRIG; without it, by angle addition from its first
    position when its visible slots are consecutive, else by a sine and a cosine per
    element (five times the arithmetic of the rest of the tile)."""
    if TRIG:
        t = trig + kpos[None, :].to(tl.int64) * HALF + wrapped(HP, HALF, HP != HALF)[:, None]
        c = tl.load(t, mask=jm[None, :], other=1.0)
        s = tl.load(t + trig_n * HALF, mask=jm[None, :], other=0.0)
    else:
        offs_n = tl.arange(0, BLOCK_N)
        rel = kpos - offs_n
        p0 = tl.max(tl.where(jm, rel, -1), 0)
        if tl.min(tl.where(jm, rel, p0), 0) == p0:
            a0 = f * p0.to(tl.float32)  # [HP, 1]
            c0 = tl.cos(a0)
            s0 = tl.sin(a0)
            c = c0 * ct - s0 * st
            s = s0 * ct + c0 * st
        else:
            ang = f * kpos[None, :].to(tl.float32)
            c = tl.cos(ang)
            s = tl.sin(ang)
    return _tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, j, jm, kpos, c, s, s_blk, s_slot,
                 qk_scale, win, cap, B, HALF, HP, True, True, WIN, CAP, PREC)


@triton.jit
def _attend(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, lo, hi, s_blk, s_slot, qk_scale,
            trig, trig_n, win, cap, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
            BLOCK_N: tl.constexpr, MASK: tl.constexpr, STEP: tl.constexpr, POS: tl.constexpr,
            SKIP: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr, TRIG: tl.constexpr,
            PREC: tl.constexpr):
    """Online softmax of the rows (q1 | q2) over keys lo .. hi-1 of one sequence.

    kc, vc: the kv head's first element in block 0; bt: the block-table row; f:
    inv_freq as [HP, 1] (0 past HALF). Without MASK every key in range must be visible
    to every row; with it, key j counts for a row at position p only if j < hi and j <= p
    (and, with WIN, j > p - win: a sliding window of win keys). With CAP, scores are
    capped at cap (`_cap`).
    STEP picks how keys at consecutive positions are rotated: 1, cos/sin of the first
    tile and an exact rotation per tile; 2, rows of the cos/sin table `trig`; 0, a sine
    and a cosine per element. With POS (needs MASK, STEP 0), slot j's position is kpt[j]
    instead of j, and a negative one hides the slot; with SKIP too, tiles no row can see
    are skipped (worth a branch in prefill, where slot order is not position order;
    decode keeps its loads at the loop's top level, where they pipeline). Scores are in
    the log2 domain (qk_scale holds log2 e).
    """
    offs_n = tl.arange(0, BLOCK_N)
    if STEP == 1:
        # cos/sin of the first tile, then a rotation by the exact angle BLOCK_N * f per
        # tile: 6 flops per element instead of a sine and a cosine.
        ang = f * (lo + offs_n)[None, :].to(tl.float32)
        c = tl.cos(ang)
        s = tl.sin(ang)
        cs = tl.cos(f * BLOCK_N)
        ss = tl.sin(f * BLOCK_N)
    ct = f  # unused with TRIG
    st = f
    if POS and not TRIG:
        # Angles of offsets 0 .. BLOCK_N-1, for tiles whose visible slots sit at
        # consecutive positions p0 + n (own tokens, runs of the Master): then
        # cos/sin(f (p0 + n)) follow from cos/sin(f p0) by angle addition.
        ang = f * offs_n[None, :].to(tl.float32)
        ct = tl.cos(ang)
        st = tl.sin(ang)
    if POS:
        qmax = tl.max(qp, 0)
        qmin = tl.min(qp, 0)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        jm = j < hi
        if POS:
            kpos = tl.load(kpt + j, mask=jm, other=-1)
            jm = jm & (kpos >= 0) & (kpos <= qmax)
            if WIN:
                jm = jm & (kpos > qmin - win)
            if SKIP:
                if tl.max(jm.to(tl.int32), 0) > 0:
                    acc, m_i, l_i = _pos_tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, f, j, jm, kpos,
                                              ct, st, s_blk, s_slot, qk_scale, trig, trig_n, win, cap,
                                              B, HALF, HP, BLOCK_N, WIN, CAP, TRIG, PREC)
            else:
                acc, m_i, l_i = _pos_tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, f, j, jm, kpos,
                                          ct, st, s_blk, s_slot, qk_scale, trig, trig_n, win, cap, B,
                                          HALF, HP, BLOCK_N, WIN, CAP, TRIG, PREC)
        else:
            if STEP == 2:
                t = trig + j[None, :].to(tl.int64) * HALF + wrapped(HP, HALF, HP != HALF)[:, None]
                c = tl.load(t, mask=jm[None, :], other=1.0)
                s = tl.load(t + trig_n * HALF, mask=jm[None, :], other=0.0)
            elif STEP == 0:
                ang = f * j[None, :].to(tl.float32)
                c = tl.cos(ang)
                s = tl.sin(ang)
            acc, m_i, l_i = _tile(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, j, jm, j, c, s,
                                  s_blk, s_slot, qk_scale, win, cap, B, HALF, HP, MASK, False,
                                  WIN and MASK, CAP, PREC)
            if STEP == 1:
                c, s = c * cs - s * ss, s * cs + c * ss
    return acc, m_i, l_i


@triton.jit
def _attend_ranges(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, lo, mid, full, hi, s_blk, s_slot,
                   qk_scale, trig, trig_n, win, cap, B: tl.constexpr, HALF: tl.constexpr,
                   HP: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, POS: tl.constexpr,
                   SKIP: tl.constexpr, WIN: tl.constexpr, CAP: tl.constexpr, TRIG: tl.constexpr,
                   PREC: tl.constexpr):
    """`_attend` over keys lo .. hi-1 in three ranges: [mid, full) where every row sees
    every key (no mask), [full, hi) masked, and with WIN, [lo, mid) masked too (where a
    sliding window starts)."""
    if WIN:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, lo, mid, s_blk, s_slot,
                                qk_scale, trig, trig_n, win, cap, B, HALF, HP, BLOCK_N, True, STEP, POS,
                                SKIP, WIN, CAP, TRIG, PREC)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, mid, full, s_blk, s_slot,
                            qk_scale, trig, trig_n, win, cap, B, HALF, HP, BLOCK_N, False, STEP, POS,
                            SKIP, WIN, CAP, TRIG, PREC)
    return _attend(acc, m_i, l_i, q1, q2, qp, kc, vc, bt, kpt, f, full, hi, s_blk, s_slot,
                   qk_scale, trig, trig_n, win, cap, B, HALF, HP, BLOCK_N, True, STEP, POS, SKIP, WIN,
                   CAP, TRIG, PREC)


def trig_table(inv_freq: torch.Tensor, n: int) -> torch.Tensor:
    """cos and sin of position * inv_freq for positions 0 .. n-1: [2, n, D/2] float32.
    Kernels read a tile of slots at scattered positions (a Mirror's patches) from it
    instead of computing a sine and a cosine per element."""
    ang = torch.arange(n, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()
    return torch.stack((ang.cos(), ang.sin())).contiguous()


def _scratch(*shape: int, device: torch.device) -> torch.Tensor:
    """fp32 workspace for partial results (tests poison it through the importing module)."""
    return torch.empty(shape, device=device, dtype=torch.float32)


def scales(q: torch.Tensor, sm_scale: float, rope_scale: float) -> tuple[str, float]:
    """(tl.dot precision for q's dtype and device, score scale in the log2 domain)."""
    prec = "ieee" if q.dtype == torch.float32 else "upcast" if not q.is_cuda else "tf32"
    return prec, sm_scale * rope_scale * LOG2E  # rope_scale scales rotated keys: fold it in


def _prep(q, k_cache, block_tables, kv_lens, inv_freq, rope_scale, sm_scale, slot_pos, trig=None):
    """(precision, the stride/scale/table arguments both kernels take, the slot-position
    table or a stand-in, inv_freq and block tables as the kernels want them)."""
    prec, qk_scale = scales(q, sm_scale, rope_scale)
    assert head_strides(q.shape[-1], *q.stride()[:2], *k_cache.stride()[:3])
    if slot_pos is not None:
        slot_pos = slot_pos.to(torch.int32).contiguous()
        assert (slot_pos.shape[0] == kv_lens.shape[0]
                and slot_pos.shape[1] >= block_tables.shape[1] * k_cache.shape[1])
    kpt = slot_pos if slot_pos is not None else kv_lens  # never read without POS
    assert trig is None or (trig.dtype == torch.float32 and trig.is_contiguous()
                            and tuple(trig.shape[::2]) == (2, inv_freq.shape[0]))
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
              slot_pos.stride(0) if slot_pos is not None else 0, qk_scale,
              kpt if trig is None else trig, 0 if trig is None else trig.shape[1])
    return (prec, common, kpt, inv_freq.to(device=q.device, dtype=torch.float32).contiguous(),
            block_tables.contiguous())
