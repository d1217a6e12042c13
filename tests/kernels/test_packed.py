"""Prepacked oneDNN linears against F.linear, and an engine that packs against one that
does not: bf16 (where this CPU's oneDNN has bf16 kernels) and float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.kernels import packed
from tokendance.kernels.packed import PackedLinear, pack, reference

BF16 = packed.supported(torch.bfloat16, "cpu")
bf16_only = pytest.mark.skipif(not BF16, reason="this CPU's oneDNN has no bf16 kernels")
DTYPES = [pytest.param(torch.bfloat16, marks=bf16_only), torch.float32]


@pytest.mark.parametrize("rows", [(1,), (3,), (4,), (8,), (300,), (2, 5), (0,)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(rows: tuple[int, ...], bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(len(rows) + rows[0])
    lin = nn.Linear(576, 960, bias=bias, dtype=dtype)  # SmolLM2's qkv shape
    nn.init.normal_(lin.weight, std=0.05)
    if bias:
        nn.init.normal_(lin.bias)
    x = torch.randn(*rows, 576, dtype=dtype)
    out = torch.full((*rows, 960), float("nan"), dtype=dtype)
    out.copy_(PackedLinear(lin)(x))
    want = reference(x, lin.weight, lin.bias)
    assert out.shape == want.shape and not out.isnan().any()
    same_as_reference(out, want)


def same_as_reference(out: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: bit-identical where oneDNN runs the same bf16 kernel both ways (the AMD EPYC
    host); on a CPU without bf16 instructions the two paths may round a few outputs the
    other way: never by more than one bf16 step. float32: equal up to the summation
    order (outputs here are ~1, a sum of 576 products)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=1e-6)
    assert (out != want).sum() <= 0.01 * out.numel()


@pytest.mark.parametrize("few", [True, False])
def test_float32_rows_pick_the_path(monkeypatch, few: bool) -> None:
    """float32, `few` (an Intel CPU): fewer than FEW rows take F.linear on the plain
    weight (exactly), more the packed one; else every input the packed one."""
    lin = nn.Linear(64, 32)
    layer = PackedLinear(lin, few=few)
    assert (layer.plain is not None) == few
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape) or real(*a), raising=False)
    one = torch.randn(1, 64)
    out = layer(one)
    assert torch.equal(out, reference(one, lin.weight, lin.bias)) if few else calls == [one.shape]
    same_as_reference(out, reference(one, lin.weight, lin.bias))
    calls.clear()
    many = torch.randn(packed.FEW, 64)
    same_as_reference(layer(many), reference(many, lin.weight, lin.bias))
    assert calls == [many.shape]


@pytest.mark.parametrize("intel", [True, False])
def test_pack_replaces_only_linears_worth_it(intel: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 4, dtype=torch.bfloat16), nn.Linear(8, 8), nn.Linear(8, 4),
                          nn.Sequential(nn.Linear(8, 4, dtype=torch.float16)))
    assert pack(model, intel) == 1 + BF16 + (not intel)
    assert isinstance(model[0], PackedLinear if BF16 else nn.Linear)  # bf16: any shape
    assert isinstance(model[1], PackedLinear)
    # float32 narrowing (a down_proj): F.linear on an Intel CPU, packed elsewhere
    assert isinstance(model[2], nn.Linear if intel else PackedLinear)
    assert isinstance(model[3][0], nn.Linear)  # no packed float16 path


def test_the_cpus_maker_decides(monkeypatch) -> None:
    """pack() without `intel` asks this CPU (/proc/cpuinfo's vendor)."""
    for intel in (True, False):
        monkeypatch.setattr(packed, "INTEL", intel)
        model = nn.Sequential(nn.Linear(8, 4))
        assert pack(model) == (not intel)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tied_embedding_survives(tiny_models, dtype: str) -> None:
    if dtype == "bfloat16" and not BF16:
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    eng = Engine(model=str(tiny_models["qwen2"]), dtype=dtype, kv_tokens=1024)
    assert eng.mcfg.tie_embeddings and isinstance(eng.model.lm_head, PackedLinear)
    assert isinstance(eng.model.layers[0].self_attn.qkv_proj, PackedLinear)
    emb = eng.model.model.embed_tokens.weight
    for rows in (1, 5):
        h = torch.randn(rows, emb.shape[1], dtype=emb.dtype)
        same_as_reference(eng.model.lm_head(h), reference(h, emb, None))


@pytest.mark.parametrize(("dtype", "intel"), [("bfloat16", False), ("float32", True), ("float32", False)])
def test_engine_tokens_unchanged(tiny_models, monkeypatch, dtype: str, intel: bool) -> None:
    if dtype == "bfloat16" and not BF16:
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    monkeypatch.setattr(packed, "INTEL", intel)
    folder = tiny_models["qwen2"]  # QKV bias
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 40, 300, 7, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fast = Engine(model=str(folder), dtype=dtype, kv_tokens=2048)
    assert isinstance(fast.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(fast.model.layers[0].mlp.down_proj, nn.Linear if dtype == "float32" and intel else PackedLinear)
    monkeypatch.setattr(packed, "supported", lambda *_: False)
    plain = Engine(model=str(folder), dtype=dtype, kv_tokens=2048)
    assert isinstance(plain.model.layers[0].mlp.gate_up_proj, nn.Linear)
    assert fast.generate(prompts, params) == plain.generate(prompts, params)
