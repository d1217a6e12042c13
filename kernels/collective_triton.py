"""Triton kernels of collective decode attention (the definition, its torch references
and the dispatch are kernels/collective.py's), and their launchers.

Kernels: the Master's keys rotated at their segment-local positions into a workspace
(grid (chunk, kv head)) once per step, not once per row tile (on an H200 30 % of the
scoring kernel's time); then the scoring kernel, grid (row tile, chunk, kv head), rows
of at most cfg["block_m"] of the S*G (a power of two >= 16), writes a partial (o, lse)
per chunk at split `split_off + chunk` of a buffer that the paged decode of the private
part shares (one reduce merges both); a third kernel merges the chunks for
`collective_attention_triton`. An empty chunk (lo = hi: padding) has no partial.
Rotations read the cos/sin table (`tiles.trig_table`); scores are in the log2 domain.
Every Master slot of a chunk must hold finite values, hidden or not.
"""

from __future__ import annotations

import math
import os

import torch

from tokendance.kernels.jit import (
    cols, fitting, head_strides, in_heads, launch_options, padded_half, tiles_head, tl, triton, wrapped,
)
from tokendance.kernels.master import MasterRead, check_segment, one_segment
from tokendance.kernels.tiles import LOG2E, _cap, _dot, _scratch, _values, _values_at, scales, trig_table


@triton.jit
def _rotate_kernel(chunks, kc, table, trig, trig_n, kr, s_blk, s_slot, s_kh, s_rj, s_rh,
                   B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of one chunk and kv head rotated at their segment-local positions (rows of the
    cos/sin table) into kr (rows of 2 * HP, each half zero past HALF), at their Master
    slot: once per step, not once per row tile."""
    ch, kvh = tl.program_id(0), tl.program_id(1)
    lo, hi, seg = tl.load(chunks + ch * 3), tl.load(chunks + ch * 3 + 1), tl.load(chunks + ch * 3 + 2)
    hm = cols(HP, HALF, HP != HALF)[None, :]
    offs_h = tl.arange(0, HP)
    offs_n = tl.arange(0, BLOCK_N)
    kc += in_heads(kvh, s_kh, HALF)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        jm = j < hi
        blk = tl.load(table + j // B, mask=jm, other=0)
        kp = kc + (blk.to(tl.int64) * s_blk + (j % B) * s_slot)[:, None] + offs_h[None, :]
        k1 = tl.load(kp, mask=jm[:, None] & hm, other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=jm[:, None] & hm, other=0.0).to(tl.float32)
        t = trig + (j - seg)[:, None].to(tl.int64) * HALF + offs_h[None, :]
        c = tl.load(t, mask=jm[:, None] & hm, other=1.0)
        s = tl.load(t + trig_n * HALF, mask=jm[:, None] & hm, other=0.0)
        o = kr + j[:, None].to(tl.int64) * s_rj + kvh * s_rh + offs_h[None, :]
        tl.store(o, (k1 * c - k2 * s).to(kr.dtype.element_ty), mask=jm[:, None])
        tl.store(o + HP, (k2 * c + k1 * s).to(kr.dtype.element_ty), mask=jm[:, None])


@triton.jit
def _collective_kernel(q, q_pos, shift, chunks, kr, vc, table, hide, trig, trig_n, o_part,
                       lse_part, n_rows, n_total, split_off, s_qt, s_qh, s_blk, s_slot, s_kh,
                       s_rj, s_rh, s_ss, s_hs, qk_scale, win, cap,
                       G: tl.constexpr, B: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIN: tl.constexpr,
                       CAP: tl.constexpr, PREC: tl.constexpr):
    mb = tl.program_id(0)
    ch = tl.program_id(1)
    kvh = tl.program_id(2)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < n_rows
    mir = rows // G
    head = kvh * G + rows % G
    lo = tl.load(chunks + ch * 3)
    hi = tl.load(chunks + ch * 3 + 1)
    if hi <= lo:  # a padding chunk (CUDA graphs plan a fixed count): its slot is never read
        return
    seg = tl.load(chunks + ch * 3 + 2)  # the segment's slot 0
    p = tl.load(q_pos + mir, mask=valid, other=0).to(tl.int32)
    sh = tl.load(shift + mir * s_ss + ch, mask=valid, other=0).to(tl.int32)
    lim = tl.where(valid, p - sh, -1)  # a row's last causally visible segment slot
    hi = tl.minimum(hi, seg + tl.max(lim, 0) + 1)  # keys past every row's limit are skipped
    if WIN:  # and in a sliding window of win keys, those before every row's window
        lo = tl.maximum(lo, seg + tl.min(tl.where(valid, lim, 1 << 30), 0) - win + 1)
    hm = cols(HP, HALF, HP != HALF)[None, :]
    dm = cols(2 * HP, 2 * HALF, HP != HALF)[None, :]
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, 2 * HP)  # an output's columns, and a rotated key's two halves in kr
    offs_v = wrapped(2 * HP, 2 * HALF, HP != HALF)  # a value's, past D wrapped (tiles.py)
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, 2 * HP], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if lo < hi:  # else no row of the tile sees the chunk: an empty partial
        # Queries arrive rotated at q_pos: rotate them back by shift (a row of the cos/sin
        # table, clamped: a shift past the table is a segment the row does not read).
        qo = in_heads(mir.to(tl.int64)[:, None], s_qt, HALF) + in_heads(head[:, None], s_qh, HALF) \
            + offs_h[None, :]
        q1 = tl.load(q + qo, mask=valid[:, None] & hm, other=0.0).to(tl.float32)
        q2 = tl.load(q + qo + HALF, mask=valid[:, None] & hm, other=0.0).to(tl.float32)
        t = trig + tl.minimum(tl.maximum(sh, 0), trig_n - 1).to(tl.int64)[:, None] * HALF + offs_h[None, :]
        c = tl.load(t, mask=hm, other=1.0)
        s = tl.load(t + trig_n * HALF, mask=hm, other=0.0)
        qa = (q1 * c + q2 * s).to(q.dtype.element_ty)
        qb = (q2 * c - q1 * s).to(q.dtype.element_ty)
        qr = tl.join(qa, qb).permute(0, 2, 1).reshape(BLOCK_M, 2 * HP)
        vc += in_heads(kvh, s_kh, HALF)
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n
            jm = j < hi
            blk = tl.load(table + j // B, mask=jm, other=0)
            k = tl.load(kr + j[None, :].to(tl.int64) * s_rj + kvh * s_rh + offs_d[:, None],
                        mask=jm[None, :], other=0.0)  # K^T, rotated
            v = _values(_values_at(vc, blk.to(tl.int64) * s_blk + (j % B) * s_slot, offs_v), jm, qr.dtype, True)
            qk = _dot(qr, k, None, PREC) * qk_scale
            if CAP:
                qk = _cap(qk, cap)
            hid = tl.load(hide + mir[:, None] * s_hs + j[None, :],
                          mask=valid[:, None] & jm[None, :], other=1)
            ok = (hid == 0) & ((j - seg)[None, :] <= lim[:, None])
            if WIN:
                ok = ok & ((j - seg)[None, :] > lim[:, None] - win)
            qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            alpha = tl.exp2(m_i - m_use)
            pr = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = _dot(pr.to(v.dtype), v, acc * alpha[:, None], PREC)
            m_i = m_new
    # A row that saw nothing leaves weight 0 (lse = -inf) and a zero partial.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    base = (mir.to(tl.int64) * (G * tl.num_programs(2)) + head) * n_total + split_off + ch
    tl.store(o_part + base[:, None] * (2 * HALF) + offs_d[None, :], acc / l_safe[:, None],
             mask=valid[:, None] & dm)
    tl.store(lse_part + base, lse, mask=valid)


@triton.jit
def _merge_kernel(o_part, lse_part, chunks, out, lse_out, NSPLIT: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr):
    r = tl.program_id(0)  # Mirror * Hq + head
    sp = tl.arange(0, NSPLIT)
    live = tl.load(chunks + sp * 3 + 1) > tl.load(chunks + sp * 3)  # empty chunks wrote nothing
    offs_d = tl.arange(0, DP)  # D columns, padded to a power of two
    dm = cols(DP, D, DP != D)
    base = r.to(tl.int64) * NSPLIT + sp
    lse = tl.load(lse_part + base, mask=live, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    den = tl.sum(w, 0)
    seen = den > 0
    den = tl.where(seen, den, 1.0)
    o = tl.load(o_part + base[:, None] * D + offs_d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
    tl.store(out + r.to(tl.int64) * D + offs_d, tl.sum(o * w[:, None], 0) / den, mask=dm)
    # back to the natural log: ln x = log2 x * ln 2
    tl.store(lse_out + r, tl.where(seen, (m + tl.log2(den)) * 0.6931471805599453, float("-inf")))


# Launch configurations: for the GPU, picked on an H200 on the engine's own decode inputs
# (Qwen2.5-7B shape, N Mirrors of a 2 k-token round, ~20 chunks; µs per layer inside a CUDA
# graph, N = 10 / 20): rows of 16, keys of 64, 4 warps 13.1 / 23.7 (+ 3.7 for the rotation);
# keys of 32 with 8 warps 18.7 / 27.1; rows of 64 with 4 warps 23.6 / 23.3. block_m caps
# a program's rows. The small tiles the interpreter runs faster with.
COLLECTIVE_CFG = dict(block_m=16, block_n=64, num_warps=4, num_stages=2)
INTERP_CFG = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
ROTATE_TILE = 32  # keys per step of the rotation kernel


def _num_splits(dev: torch.device, programs: int, master_len: int, block_n: int) -> int:
    """Splits of the Master: about two programs per SM in all, at least a tile each."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    ns = min(16, triton.next_power_of_2(max(1, 2 * sms // max(programs, 1))))
    while ns > 1 and ns * block_n > master_len:
        ns //= 2
    return ns


def row_tiles(n_rows: int, block_m: int) -> tuple[int, int]:
    """(tiles, BLOCK_M): the fewest tiles of at most block_m rows, each a power of two
    of at least 16 rows (tl.dot's minimum)."""
    tiles = max(1, -(-n_rows // block_m))
    return tiles, max(16, triton.next_power_of_2(-(-n_rows // tiles)))


def collective_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    shift: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    master_table: torch.Tensor,
    master_len: int,
    hide: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
    *,
    num_splits: int | None = None,
    cfg: dict | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    trig: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of `collective_attention`. num_splits (a power of two) and cfg
    override the launch; out, contiguous float32 ([S, Hq, D], [S, Hq]), gets the result;
    trig: see `collective_partials`."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("collective_attention_triton needs CUDA tensors (or TRITON_INTERPRET=1)")
    check_segment(q, q_pos, shift, k_cache, v_cache, master_table, master_len, hide, inv_freq)
    S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if not tiles_head(D):
        raise ValueError(f"head dim {D} must be even, 16 to 256")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides, unit stride on D")
    if out is None:
        out = (torch.empty(S, Hq, D, device=q.device, dtype=torch.float32),
               torch.empty(S, Hq, device=q.device, dtype=torch.float32))
    o, lse = out
    if (o.shape != (S, Hq, D) or lse.shape != (S, Hq) or o.dtype != torch.float32
            or lse.dtype != torch.float32 or not (o.is_contiguous() and lse.is_contiguous())):
        raise ValueError("out must be contiguous float32 ([S, Hq, D], [S, Hq])")
    if S == 0 or master_len == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    G = Hq // Hkv
    interp = not q.is_cuda
    c = {**(INTERP_CFG if interp else COLLECTIVE_CFG), **(cfg or {})}
    tiles, block_m = row_tiles(S * G, c["block_m"])
    ns = num_splits or _num_splits(q.device, tiles * Hkv, master_len, c["block_n"])
    if ns & (ns - 1):
        raise ValueError(f"num_splits={ns} must be a power of two")
    o_part = _scratch(S, Hq, ns, D, device=q.device)
    lse_part = _scratch(S, Hq, ns, device=q.device)
    read = one_segment(shift, master_table, master_len, hide.contiguous(), ns, c["block_n"])
    collective_partials(q, q_pos, k_cache, v_cache, read, inv_freq, rope_scale, sm_scale,
                        o_part, lse_part, 0, cfg=c, trig=trig)
    _merge_kernel[(S * Hq,)](o_part, lse_part, read.chunks, o, lse, NSPLIT=ns, D=D,
                             DP=2 * padded_half(D), num_warps=4)
    return o, lse


def collective_partials(q, q_pos, k_cache, v_cache, read: MasterRead, inv_freq,
                        rope_scale: float, sm_scale: float, o_part: torch.Tensor,
                        lse_part: torch.Tensor, split_off: int, cfg: dict | None = None,
                        trig: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> None:
    """Launch the collective kernels: the Master's keys rotated into a workspace, then
    chunk c's partial (o, log2 lse) of Mirror s, head h into o_part[s, h, split_off + c],
    lse_part[s, h, split_off + c] (float32 buffers [S, Hq, n, D] and [S, Hq, n],
    contiguous), for every chunk that is not empty. Rotations read rows of trig
    (`tiles.trig_table` of inv_freq, a row for every shift and segment slot); without it
    one is built, after a host sync for its length (not the engine's path). window, softcap:
    as in `paged_attention` (0: none)."""
    S, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    c = {**(COLLECTIVE_CFG if q.is_cuda else INTERP_CFG), **(cfg or {})}
    tiles, block_m = row_tiles(S * G, c["block_m"])
    n_chunks = read.chunks.shape[0]
    if S == 0 or n_chunks == 0:
        return
    q = q.contiguous() if q.stride(-1) != 1 else q
    if trig is None:
        trig = trig_table(inv_freq.to(q.device), max(int(q_pos.max()) + 1, read.table.numel() * B))
    assert trig.dtype == torch.float32 and trig.is_contiguous() and tuple(trig.shape[::2]) == (2, D // 2)
    prec, qk_scale = scales(q, sm_scale, rope_scale)
    hide = read.hide.view(torch.uint8) if read.hide.dtype == torch.bool else read.hide
    assert hide.stride(1) == 1 and read.shift.stride(1) == 1 and o_part.is_contiguous()
    assert head_strides(D, *q.stride()[:2], *k_cache.stride()[:3])
    # Rotated keys at their Master slots (only the chunks' slots are written or read), in q's dtype.
    hp = padded_half(D)
    kr = torch.empty(read.table.numel() * B, Hkv, 2 * hp, device=q.device, dtype=q.dtype)
    _rotate_kernel[(n_chunks, Hkv)](
        read.chunks, k_cache, read.table, trig, trig.shape[1], kr,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), kr.stride(0), kr.stride(1),
        B=B, HALF=D // 2, HP=hp, BLOCK_N=ROTATE_TILE if q.is_cuda else c["block_n"], num_warps=4,
    )

    def launch(c: dict) -> None:
        _collective_kernel[(tiles, n_chunks, Hkv)](
            q, q_pos, read.shift, read.chunks, kr, v_cache, read.table, hide, trig, trig.shape[1],
            o_part, lse_part, S * G, o_part.shape[2], split_off,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            kr.stride(0), kr.stride(1), read.shift.stride(0), hide.stride(0), qk_scale, window,
            softcap * LOG2E, G=G, B=B, HALF=D // 2, HP=hp, BLOCK_M=block_m, BLOCK_N=c["block_n"],
            WIN=window > 0, CAP=softcap > 0, PREC=prec, **launch_options(c))

    # wide heads in float32 may ask for more shared memory than the GPU has: smaller tiles then
    fitting(("collective", q.device, q.dtype, k_cache.dtype, D, G, B, block_m, window > 0, softcap > 0),
            c, (dict(block_n=32), dict(block_n=32, num_stages=1)), launch)
