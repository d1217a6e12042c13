"""Prepacked oneDNN linears against F.linear, and an engine that packs against one that
does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.kernels import packed
from tokendance.kernels.packed import PackedLinear, pack, reference

pytestmark = pytest.mark.skipif(not packed.supported(torch.bfloat16, "cpu"),
                                reason="this CPU's oneDNN has no bf16 kernels")


@pytest.mark.parametrize("rows", [(1,), (8,), (300,), (2, 5), (0,)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(len(rows) + rows[0])
    lin = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16)  # SmolLM2's qkv shape
    nn.init.normal_(lin.weight, std=0.05)
    if bias:
        nn.init.normal_(lin.bias)
    x = torch.randn(*rows, 576, dtype=torch.bfloat16)
    out = torch.full((*rows, 960), float("nan"), dtype=torch.bfloat16)
    out.copy_(PackedLinear(lin)(x))
    want = reference(x, lin.weight, lin.bias)
    assert out.shape == want.shape and not out.isnan().any()
    same_as_reference(out, want)


def same_as_reference(out: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical where oneDNN runs the same bf16 kernel both ways (the AMD EPYC host);
    on a CPU without bf16 instructions the two paths may round a few outputs the other
    way: never by more than one bf16 step."""
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=1e-6)
    assert (out != want).sum() <= 0.01 * out.numel()


def test_pack_replaces_only_supported_linears() -> None:
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16), nn.Linear(8, 8),
                          nn.Sequential(nn.Linear(8, 4, dtype=torch.bfloat16)))
    assert pack(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(model[1], nn.Linear)  # fp32 keeps F.linear (the exact reference)


def test_tied_embedding_survives(tiny_models) -> None:
    eng = Engine(model=str(tiny_models["qwen2"]), dtype="bfloat16", kv_tokens=1024)
    assert eng.mcfg.tie_embeddings and isinstance(eng.model.lm_head, PackedLinear)
    assert isinstance(eng.model.layers[0].self_attn.qkv_proj, PackedLinear)
    emb = eng.model.model.embed_tokens.weight
    h = torch.randn(3, emb.shape[1], dtype=torch.bfloat16)
    same_as_reference(eng.model.lm_head(h), reference(h, emb, None))


def test_engine_tokens_unchanged(tiny_models, monkeypatch) -> None:
    folder = tiny_models["qwen2"]  # QKV bias
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fast = Engine(model=str(folder), dtype="bfloat16", kv_tokens=2048)
    assert isinstance(fast.model.layers[0].mlp.gate_up_proj, PackedLinear)
    monkeypatch.setattr(packed, "supported", lambda *_: False)
    plain = Engine(model=str(folder), dtype="bfloat16", kv_tokens=2048)
    assert isinstance(plain.model.layers[0].mlp.gate_up_proj, nn.Linear)
    assert fast.generate(prompts, params) == plain.generate(prompts, params)
