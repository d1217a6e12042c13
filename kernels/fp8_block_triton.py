"""The Triton product of block-wise 8-bit weights (kernels/fp8_block.py holds its reference
and the module that calls it): rows rounded per group of bk columns times an e4m3 weight
under a scale per bn x bk block. A program holds a tile of the output and walks K one
block at a time: each block's partial product in float32, scaled by its rows' group
scales and its columns' block scale, then summed, as the reference sums the scaled
products. On FP8 tensor cores (compute capability 8.9 and up) the partial product takes
the e4m3 operands as they are; elsewhere (the interpreter included) float16 operands,
which hold e4m3 exactly.

Programs are ordered in groups of GROUP_M row tiles: the programs running together share
a few row tiles and a band of weight columns, so a prefill reads the weight from memory
about M / (GROUP_M * BLOCK_M) times instead of once per row tile. A decode step's few rows
make one row tile and too few column tiles to fill the GPU's SMs where N is narrow (a
down projection's 4,096 columns are 64 tiles of 64): `split_k` programs each take every
split_k-th block of K into a float32 partial, which torch then sums.
"""

from __future__ import annotations

import torch

from tokendance.kernels.jit import launch_options, tl, triton

# A decode step's few rows (K split as `split_k` says), up to MID_ROWS, and more (where torch's
# block-scaled product does not take them): the fastest of bench/fp8_block.py --sweep on an
# H100 at Qwen3-8B's widths (docs/benchmarks.md, session 67)
FEW = dict(block_m=16, block_n=64, num_warps=4, num_stages=3, group_m=1)
MID = dict(block_m=64, block_n=64, num_warps=4, num_stages=4, group_m=8)
MANY = dict(block_m=64, block_n=128, num_warps=4, num_stages=4, group_m=8)
MID_ROWS = 64


@triton.jit
def _block_kernel(xq, xs, w, ws, bias, out, M, N, K, KB, s_x, s_w, s_o, HAS_BIAS: tl.constexpr,
                  E4M3_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                  GROUP_N: tl.constexpr, GROUP_K: tl.constexpr):
    pid, tiles_m, tiles_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    part_k, splits = tl.program_id(1), tl.num_programs(1)
    out += part_k.to(tl.int64) * M * s_o  # this split's partial
    first = pid // (GROUP_M * tiles_n) * GROUP_M
    height = tl.minimum(tiles_m - first, GROUP_M)
    rows = (first + pid % (GROUP_M * tiles_n) % height) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid % (GROUP_M * tiles_n) // height * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    rm, cn = rows < M, cols < N
    a_ptr = xq + rows[:, None].to(tl.int64) * s_x + ks[None, :]
    b_ptr = w + cols[:, None].to(tl.int64) * s_w + ks[None, :]
    sa_ptr = xs + rows.to(tl.int64) * KB
    sb_ptr = ws + (cols // GROUP_N).to(tl.int64) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(part_k, KB, splits):
        k0 = kb * GROUP_K
        a = tl.load(a_ptr + k0, mask=rm[:, None], other=0.0)
        b = tl.load(b_ptr + k0, mask=cn[:, None], other=0.0)
        if not E4M3_DOT:
            a, b = a.to(tl.float16), b.to(tl.float16)
        part = tl.dot(a, tl.trans(b))
        sa = tl.load(sa_ptr + kb, mask=rm, other=0.0)
        sb = tl.load(sb_ptr + kb, mask=cn, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        if part_k == 0:  # once
            acc += tl.load(bias + cols, mask=cn, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * s_o + cols[None, :], acc, mask=rm[:, None] & cn[None, :])


def split_k(tiles: int, kb: int, sms: int) -> int:
    """How many ways a decode step splits K: the fewest (a power of two, at most the `kb`
    blocks of K) that give `tiles` output tiles 1.5 waves of programs over `sms` SMs (on
    an H100 a qkv projection's 96 tiles of 64 columns split 4 ways, down's 64 too, gate_up's
    384 not at all)."""
    k = 1
    while tiles * k < 1.5 * sms and 2 * k <= kb:
        k *= 2
    return k


def block_linear_triton(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int], bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16, cfg: dict | None = None) -> torch.Tensor:
    """(xq * xs, per group of bk columns) @ (w8 * w_scale, per bn x bk block).T (+ bias) for
    rounded rows xq [M, K] (scales [M, K / bk]) and an e4m3 weight [N, K] (scales
    [N / bn, K / bk]), in `out_dtype`. K must be whole groups, N whole blocks. `cfg` (default:
    FEW, MID or MANY by the row count) may also set `split_k` (default: `split_k`'s for
    few rows, else 1) and `e4m3_dot` (default: on a GPU with FP8 tensor cores)."""
    (m, k), n = xq.shape, w8.shape[0]
    bn, bk = block
    assert w8.shape[1] == k and k % bk == 0 and n % bn == 0 and xq.stride(-1) == w8.stride(-1) == 1
    assert xs.shape == (m, k // bk) and w_scale.shape == (n // bn, k // bk)
    c = {**(FEW if m <= FEW["block_m"] else MID if m <= MID_ROWS else MANY), **(cfg or {})}
    e4m3 = c.get("e4m3_dot", xq.is_cuda and torch.cuda.get_device_capability(xq.device) >= (8, 9))
    tiles = triton.cdiv(m, c["block_m"]) * triton.cdiv(n, c["block_n"])
    if "split_k" in c:
        splits = min(c["split_k"], k // bk)
    elif m <= FEW["block_m"] and xq.is_cuda:
        splits = split_k(tiles, k // bk, torch.cuda.get_device_properties(xq.device).multi_processor_count)
    else:
        splits = 1
    out = torch.empty(splits, m, n, device=xq.device, dtype=out_dtype if splits == 1 else torch.float32)
    grid = (tiles, splits)
    _block_kernel[grid](xq, xs.contiguous(), w8, w_scale.contiguous(), bias if bias is not None else w_scale, out,
                        m, n, k, k // bk, xq.stride(0), w8.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                        E4M3_DOT=e4m3, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], GROUP_M=c["group_m"],
                        GROUP_N=bn, GROUP_K=bk, **launch_options(c))
    return out[0] if splits == 1 else out.sum(0).to(out_dtype)
