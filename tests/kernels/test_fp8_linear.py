"""8-bit float weights (kernels/fp8_linear.py): the row quantization, the reference against
exact products, the Triton kernels against the references (under the interpreter; on a GPU,
bench/check_quant.py), and which of a model's layers are replaced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokendance.kernels import fp8_linear as fl
from tokendance.kernels import fp8_triton as ft

from .test_paged_attention import rel


def test_rows_scale_to_e4m3s_range_and_round_within_its_precision():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]  # rows of every magnitude
    x[3] = 0.0
    q, scale = fl.quantize_rows(x)
    assert q.dtype == fl.E4M3 and scale.shape == (8, 1)
    back = q.float() * scale
    top = q.float().abs().amax(-1)
    assert torch.equal(top[top > 0], torch.full_like(top[top > 0], ft.TOP))  # each row's largest is 448
    assert torch.equal(back[3], torch.zeros(64))  # a row of zeros stays one, no NaN
    normal = back.abs() >= scale * 2.0**-6  # e4m3's normal range: 3 mantissa bits
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + 1e-30)[normal].all()


def test_the_reference_is_exact_where_both_sides_are_e4m3_values():
    """Inputs and weights that e4m3 holds exactly under scales of powers of two: the
    reference's product is the float64 product (a scale applied twice, or to the wrong
    side, fails here)."""
    torch.manual_seed(1)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 3.0, 6.5, 13.0, 448.0])
    x = values[torch.randint(0, 8, (5, 32))] * 2.0 ** torch.arange(5)[:, None]
    w = values[torch.randint(0, 8, (48, 32))] * -(2.0 ** -torch.arange(48).remainder(4)[:, None])
    x[:, 0], w[:, 0] = 448.0 * 2.0 ** torch.arange(5), -448.0 * 2.0 ** -torch.arange(48).remainder(4)
    w8, ws = fl.quantize_rows(w)
    bias = torch.arange(48.0)
    got = fl.fp8_linear_reference(x, w8, ws, bias)
    assert torch.equal(got.double(), x.double() @ w.double().t() + bias.double())


def test_the_reference_stays_near_the_wide_product():
    torch.manual_seed(2)
    x, w = torch.randn(2, 7, 256), torch.randn(384, 256) / 16
    w8, ws = fl.quantize_rows(w)
    got = fl.fp8_linear_reference(x, w8, ws)
    assert got.shape == (2, 7, 384) and got.dtype == x.dtype
    assert rel(got, x @ w.t()) < 0.05


def rows_case(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows longer than a block (5,000: two of 4,096, the second masked), of every magnitude,
    one of zeros, strided."""
    torch.manual_seed(4)
    x = (torch.randn(6, 5200, device=device) * torch.logspace(-4, 4, 6, device=device)[:, None]).to(dtype)[:, :5000]
    x[2] = 0
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rows_kernel_rounds_as_the_reference(dtype: torch.dtype):
    """The same scales, and the same e4m3 values but where Triton's interpreter (3.9) rounds
    otherwise: a tie away from zero (84 -> 88, not to the even 80), a value up to a power
    of two without the carry (1.99 -> 1.0). The GPU's conversion has neither slip; there the
    bytes are equal (bench/check_quant.py)."""
    x = rows_case(dtype)
    q, s = ft.quantize_rows_triton(x)
    want_q, want_s = fl.quantize_rows(x)
    assert torch.equal(s, want_s)
    got, want = q.float(), want_q.float()
    step = 2.0 ** (want.abs().clamp_min(2.0**-6).log2().floor() - 3)  # e4m3's spacing at each value
    slip = got != want
    tie = (got - want).abs() <= step
    carry = (want == 2 * got) & (want.abs().log2() % 1 == 0)
    assert (tie | carry)[slip].all() and slip.float().mean() < 0.05


def test_rows_under_a_static_scale_saturate_and_the_kernel_agrees():
    """A checkpoint's input scale for every row: what passes 448 of it saturates, and the
    kernel gives the reference's scales and bytes (these values round alike in both)."""
    x = torch.tensor([[1.0, -2.0, 3.0, 1000.0], [0.5, 0.25, -2000.0, 0.0]])
    fixed = torch.tensor(0.5)
    q, s = fl.quantize_rows(x, fixed)
    assert torch.equal(s, torch.full((2, 1), 0.5))
    assert q.float().tolist() == [[2.0, -4.0, 6.0, 448.0], [1.0, 0.5, -448.0, 0.0]]
    got_q, got_s = ft.quantize_rows_triton(x, fixed)
    assert torch.equal(got_s, s) and torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
    w8, ws = fl.quantize_rows(torch.randn(16, 4))
    want = (q.float() * 0.5) @ (w8.float() * ws).t()
    assert torch.allclose(fl.fp8_linear_reference(x, w8, ws, None, fixed), want, rtol=1e-6)


def test_a_module_starts_as_nn_linear_does_and_rounds_one_given():
    torch.manual_seed(6)
    f = fl.Fp8Linear(96, 40, bias=True, static=True)
    w = f.wide(torch.float32)
    assert w.shape == (40, 96) and w.abs().max() <= 96**-0.5 and w.std() > 0.5 * 96**-0.5 / 3**0.5
    assert f.bias.abs().max() <= 96**-0.5 and f.input_scale.item() == 1.0 and "static input scale" in repr(f)
    lin = nn.Linear(96, 40)
    g = fl.Fp8Linear.of(lin)
    assert g.bias is lin.bias and g.input_scale is None
    w8, ws = fl.quantize_rows(lin.weight.detach())
    assert torch.equal(g.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(g.scale, ws)


@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("cfg", [{}, dict(block_n=32, block_k=32)])
def test_the_few_rows_kernel_computes_the_references_product(rows: int, cfg: dict):
    """Widths no tile divides (48 of 16 or 32, 80 of 256 or 32): masked edges; a bias."""
    torch.manual_seed(5)
    x, w, bias = torch.randn(rows, 80), torch.randn(48, 80) / 8, torch.randn(48)
    w8, ws = fl.quantize_rows(w)
    xq, xs = fl.quantize_rows(x)
    got = ft.few_rows_triton(xq, xs, w8, ws, bias.to(torch.bfloat16), cfg=cfg)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    assert rel(got, fl.fp8_linear_reference(x, w8, ws, bias.to(torch.bfloat16).float())) < 1e-2


def test_a_models_projections_are_replaced_and_nothing_else():
    class MLP(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.gate_up_proj, self.down_proj = nn.Linear(64, 2 * width), nn.Linear(width, 64)
            self.gate = nn.Linear(64, 8)  # a router

    class Layer(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.qkv_proj, self.o_proj, self.mlp = nn.Linear(64, 96), nn.Linear(64, 64), MLP(width)

    model = nn.Sequential(Layer(128), Layer(72), nn.Linear(64, 1000))  # 72: not a multiple of 16
    w = model[0].qkv_proj.weight.detach().clone()
    assert fl.quantize(model) == 7  # 4 + qkv and o of the second layer, and its gate_up (144 wide)
    assert isinstance(model[0].mlp.down_proj, fl.Fp8Linear) and isinstance(model[1].mlp.gate_up_proj, fl.Fp8Linear)
    assert isinstance(model[1].mlp.down_proj, nn.Linear) and isinstance(model[0].mlp.gate, nn.Linear)
    assert isinstance(model[2], nn.Linear)
    f = model[0].qkv_proj
    assert f.weight.dtype == fl.E4M3 and rel(f.weight.float() * f.scale, w) < 0.05
    assert "e4m3" in repr(f)
