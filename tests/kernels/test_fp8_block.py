"""Block-wise 8-bit float weights (kernels/fp8_block.py): blocks and groups rounded as the
rows are, the reference against exact products, the Triton product against the reference
(under the interpreter), and the module."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels import fp8_block as fb
from tokendance.kernels import fp8_linear as fl
from tokendance.kernels.fp8_block_triton import block_linear_triton, split_k

from .test_paged_attention import rel


def test_each_block_and_group_is_rounded_as_a_row_of_its_own():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-2, 2, 64)[:, None]  # blocks of every magnitude
    q, s = fb.quantize_blocks(w, 32, 16)
    assert q.shape == (64, 96) and s.shape == (2, 6)
    for i in range(2):
        for j in range(6):
            bq, bs = fl.quantize_rows(w[32 * i:32 * (i + 1), 16 * j:16 * (j + 1)].reshape(1, -1))
            assert torch.equal(q[32 * i:32 * (i + 1), 16 * j:16 * (j + 1)].reshape(1, -1).view(torch.uint8),
                               bq.view(torch.uint8))
            assert s[i, j] == bs.item()
    x = torch.randn(3, 96)
    xq, xs = fb.quantize_groups(x, 32)
    rq, rs = fl.quantize_rows(x.reshape(9, 32))
    assert xs.shape == (3, 3) and torch.equal(xs.flatten(), rs.flatten())
    assert torch.equal(xq.view(torch.uint8).flatten(), rq.view(torch.uint8).flatten())


def test_the_reference_is_exact_where_both_sides_are_e4m3_values():
    """Values e4m3 holds exactly, each block and group with its own power-of-two scale (its
    largest 448 times it): the product is the float64 one, so each scale lands on its block
    (a block's scale taken by the wrong rows or columns fails here)."""
    torch.manual_seed(1)
    values = torch.tensor([0.0, 1.0, 1.5, 3.0, 6.5, 13.0])  # few enough magnitudes for float32's sums
    w = values[torch.randint(0, 6, (64, 64))]
    w[::16, ::16] = 448.0  # each 16 x 16 block's largest
    w = w * fb.spread(2.0 ** -(torch.arange(16.0) % 4).reshape(4, 4), 16, 16, 64, 64)
    x = values[torch.randint(0, 6, (5, 64))]
    x[:, ::16] = 448.0  # each group's largest
    x = x * (2.0 ** (torch.arange(20.0) % 2).reshape(5, 4)).repeat_interleave(16, 1)
    w8, ws = fb.quantize_blocks(w, 16, 16)
    bias = torch.arange(64.0)
    got = fb.block_linear_reference(x, w8, ws, (16, 16), bias)
    assert torch.equal(got.double(), x.double() @ w.double().t() + bias.double())


@pytest.mark.parametrize("shape", [(64, 96), (3, 64, 96), (70, 100)])
def test_dequantize_gives_each_weight_its_blocks_scale(shape: tuple[int, ...]):
    """Whole blocks (by broadcasting), stacked experts' blocks, and partial last blocks
    (each weight's scale spread out): every weight times its own block's scale."""
    torch.manual_seed(5)
    w = torch.randn(*shape)
    q, s = zip(*(fb.quantize_blocks(x, 32, 16) for x in w.reshape(-1, *shape[-2:])))
    q, s = torch.stack(q).reshape(shape), torch.stack(s).reshape(*shape[:-2], *s[0].shape)
    want = fl.widen(q) * fb.spread(s, 32, 16, *shape[-2:])
    assert torch.equal(fb.dequantize(q.view(torch.uint8), s, (32, 16)), want)
    i, j = shape[-2] - 1, shape[-1] - 1  # the last weight: the last block's scale
    assert want[..., i, j].equal(fl.widen(q[..., i, j]) * s[..., i // 32, j // 16])


@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("block", [(16, 32), (32, 16), (64, 64)])
def test_the_triton_product_is_the_references(rows: int, block: tuple[int, int]):
    """Few rows (one tile of 16), up to MID_ROWS (one tile of 64 x 64) and more (tiles of
    64 x 128, the last masked); output tiles wider and narrower than a block's rows; a bias."""
    torch.manual_seed(2)
    x, w, bias = torch.randn(rows, 128), torch.randn(192, 128) / 8, torch.randn(192)
    w8, ws = fb.quantize_blocks(w, *block)
    xq, xs = fb.quantize_groups(x, block[1])
    got = block_linear_triton(xq, xs, w8, ws, block, bias.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    want = fb.block_linear_reference(x, w8, ws, block, bias.to(torch.bfloat16).float())
    assert rel(got, want) < 1e-2
    assert rel(want, x @ w.t() + bias) < 0.08  # and near the wide product


@pytest.mark.parametrize("e4m3_dot", [False, True])
def test_programs_in_groups_of_row_tiles_cover_every_tile_once(e4m3_dot: bool):
    """Five row tiles in groups of two (the last group short) over three column tiles; the
    partial products over e4m3 operands as FP8 tensor cores take them, and over float16."""
    torch.manual_seed(4)
    x, w = torch.randn(75, 64), torch.randn(96, 64) / 8
    w8, ws = fb.quantize_blocks(w, 32, 32)
    xq, xs = fb.quantize_groups(x, 32)
    cfg = dict(block_m=16, block_n=32, num_warps=4, num_stages=2, group_m=2, e4m3_dot=e4m3_dot)
    got = block_linear_triton(xq, xs, w8, ws, (32, 32), out_dtype=torch.float32, cfg=cfg)
    assert rel(got, fb.block_linear_reference(x, w8, ws, (32, 32))) < 1e-5


@pytest.mark.parametrize("split_k", [2, 3, 9])
def test_programs_that_split_k_sum_to_the_product(split_k: int):
    """K of four blocks split two, three (shares of 2, 1 and 1 blocks) and nine ways (more
    splits than blocks: one a block); the bias added once."""
    torch.manual_seed(5)
    x, w, bias = torch.randn(3, 128), torch.randn(64, 128) / 8, torch.randn(64)
    w8, ws = fb.quantize_blocks(w, 32, 32)
    xq, xs = fb.quantize_groups(x, 32)
    cfg = dict(block_m=16, block_n=32, num_warps=4, num_stages=2, group_m=1, split_k=split_k)
    got = block_linear_triton(xq, xs, w8, ws, (32, 32), bias, out_dtype=torch.float32, cfg=cfg)
    assert rel(got, fb.block_linear_reference(x, w8, ws, (32, 32), bias)) < 1e-5


def test_a_decode_step_splits_k_until_the_programs_fill_the_gpu():
    """On 132 SMs (an H100's): 96 tiles split 4 ways (192 programs are short of 1.5 waves),
    384 tiles none, and never into more splits than K has blocks."""
    assert [split_k(t, 32, 132) for t in (96, 64, 384, 198, 197)] == [4, 4, 1, 1, 2]
    assert split_k(1, 3, 132) == 2 and split_k(1, 1, 132) == 1


def test_the_module_starts_as_nn_linear_does_and_takes_whole_blocks():
    torch.manual_seed(3)
    f = fb.BlockFp8Linear(96, 64, (32, 32), bias=True)
    w = f.wide(torch.float32)
    assert w.shape == (64, 96) and f.scale.shape == (2, 3) and "(32, 32) blocks" in repr(f)
    assert w.abs().max() <= 96**-0.5 and w.std() > 0.5 * 96**-0.5 / 3**0.5
    x = torch.randn(4, 96)
    assert torch.equal(f(x), fb.block_linear_reference(x, f.weight, f.scale, (32, 32), f.bias))
    g = fb.BlockFp8Linear(96, 64, (32, 32), start=False)
    q, s = fb.quantize_blocks(w, 32, 32)
    g.put(32, q[32:], s[1:])
    g.put(0, q[:32], s[:1])
    assert torch.equal(g.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(g.scale, s)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        g.put(16, q[:32], s[:1])
    with pytest.raises(ValueError, match="64 x 80 is not whole blocks of 32 x 32"):
        fb.BlockFp8Linear(80, 64, (32, 32))


def test_a_refusal_of_torchs_block_product_is_kept_and_said(monkeypatch):
    """The first refusal of `F.scaled_mm` is this device's verdict: said by
    `cublas_refusal`, never asked again."""
    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise RuntimeError("no block-wise scales here\nmore")

    monkeypatch.setattr(fb, "_CUBLAS", {})
    monkeypatch.setattr(fb.F, "scaled_mm", refuse, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build's raises
    x, w = torch.randn(5, 512), torch.randn(256, 512) / 16
    w8, ws = fb.quantize_blocks(w, 128, 128)
    assert fb.cublas_refusal(x.device) is None
    assert fb.cublas(x, w8, ws, (128, 128)) is None and fb.cublas(x, w8, ws, (128, 128)) is None
    assert calls == [1] and fb.cublas_refusal(x.device) == "RuntimeError: no block-wise scales here"
    assert fb.cublas(x, w8, ws, (64, 64)) is None and calls == [1]  # blocks it never takes: not asked
