"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE): the engine gives HF's greedy tokens,
reuses as for Llama, and reads each architecture's expert fields and names; what it
cannot load is a one-line error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine
from tokendance.backend.moe import MoE, route

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
KINDS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # layer 1 of 3 keeps a dense MLP (mlp_only_layers), whose width differs from an expert's
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    # a shared expert of its own width; only every second layer sparse (decoder_sparse_step)
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                      shared_expert_intermediate_size=40, decoder_sparse_step=2),
    # clip_qkv low enough to clamp: without the clamp the tokens differ
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=0.5),
    # every expert in one checkpoint tensor; Granite's multipliers, the residual one folded
    # into each expert's down projection
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=1.5, logits_scaling=2.0),
}


@pytest.fixture(scope="module")
def moes(make_model):
    return {a: make_model(a, num_hidden_layers=3, pad_token_id=0, **over) for a, over in KINDS.items()}


@pytest.mark.parametrize("arch", list(KINDS))
def test_moe_matches_hf(moes, arch):
    eng = Engine(model=str(moes[arch]), dtype="float32", kv_tokens=8192, max_batched_tokens=512)
    sparse = [isinstance(layer.mlp, MoE) for layer in eng.model.layers]
    assert sparse == {"qwen3_moe": [True, False, True], "qwen2_moe": [False, True, False]}.get(arch, [True] * 3)
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 700), seed=7)
    ours = eng.generate(prompts, GREEDY)
    for (toks, _, _), want in zip(ours, hf_greedy(moes[arch], prompts, 24)):
        same_tokens(toks, want)
    variants = prompts + [p[: len(p) // 2] + [5, 6, 7] for p in prompts]
    full = eng.generate(variants, GREEDY)
    assert eng.generate(variants, GREEDY, mode="prefix") == full


def test_moe_reuses_as_llama_does(moes):
    reuses_as_llama_does(moes["qwen3_moe"])


@pytest.mark.parametrize("arch", list(KINDS))
def test_a_sparse_layer_computes_what_transformers_does(moes, arch):
    """A sparse layer's MoE against HF's on the same states: routing (renormalised or
    not), each expert's gate and up rows, the weighted sum, a shared expert and its gate."""
    from transformers import AutoModelForCausalLM

    i = 1 if arch == "qwen2_moe" else 0  # the first sparse layer
    ours = loader.load(moes[arch], ModelConfig.load(moes[arch]), torch.float32, "cpu").model.layers[i].mlp
    layer = AutoModelForCausalLM.from_pretrained(moes[arch], dtype=torch.float32).model.layers[i]
    theirs = layer.block_sparse_moe if arch == "granitemoe" else layer.mlp
    assert isinstance(ours, MoE)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 0.1  # routing far from one-hot
    with torch.no_grad():
        want = theirs(x[None])
        # Granite's residual multiplier: HF's layer applies it, ours holds it in the weights
        want = (want[0] if isinstance(want, tuple) else want).reshape(40, 64) * KINDS[arch].get("residual_multiplier", 1)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-6)


def test_the_router_picks_what_transformers_picks():
    torch.manual_seed(0)
    logits = torch.randn(6, 8)
    w, ids = route(logits, 3, norm=False)
    p = logits.softmax(-1)
    torch.testing.assert_close(w, p.gather(1, ids))
    assert (p.gather(1, ids).min(1).values >= p.topk(3).values[:, -1]).all()
    wn, idn = route(logits, 3, norm=True)
    assert torch.equal(idn, ids)
    torch.testing.assert_close(wn.sum(-1), torch.ones(6))


def test_config_fields(moes):
    q = ModelConfig.load(moes["qwen3_moe"])
    assert (q.experts, q.experts_per_token, q.expert_size, q.norm_topk, q.dense_layers, q.qk_norm) == (
        8, 3, 48, True, (1,), "head")
    m = ModelConfig.load(moes["mixtral"])
    assert (m.experts, m.expert_size, m.norm_topk, m.dense_layers, m.qk_norm) == (4, 128, True, (), None)
    o = ModelConfig.load(moes["olmoe"])
    assert (o.experts, o.norm_topk, o.qk_norm, o.clip_qkv) == (4, False, "all", 0.5)


def _edited(src, tmp_path, name: str, **over):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(over)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("over,msg", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds the 8 experts"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size must be a positive integer, not None"),
    (dict(num_experts=0), "num_experts must be a positive integer, not 0"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers layer indices below 3"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
])
def test_bad_expert_fields_are_one_line_errors(moes, tmp_path, over, msg):
    with pytest.raises(InvalidRequest, match=msg):
        ModelConfig.load(_edited(moes["qwen3_moe"], tmp_path, "bad", **over))


def test_a_checkpoint_short_of_an_expert_or_with_one_too_many(moes, tmp_path):
    src = moes["mixtral"]
    weights = load_file(src / "model.safetensors")
    missing = _edited(src, tmp_path, "missing")
    save_file({k: v for k, v in weights.items() if ".experts.3.w2." not in k}, missing / "model.safetensors")
    with pytest.raises(InvalidRequest, match="missing weights"):
        Engine(model=str(missing), dtype="float32", kv_tokens=1024)
    extra = _edited(src, tmp_path, "extra")
    w = weights["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()
    save_file({**weights, "model.layers.0.block_sparse_moe.experts.4.w1.weight": w}, extra / "model.safetensors")
    with pytest.raises(InvalidRequest, match="unexpected weight model.layers.0.block_sparse_moe.experts.4"):
        Engine(model=str(extra), dtype="float32", kv_tokens=1024)
    wide = _edited(src, tmp_path, "wide", intermediate_size=64)  # the experts hold 128 rows
    with pytest.raises(InvalidRequest, match="not what the config gives"):
        Engine(model=str(wide), dtype="float32", kv_tokens=1024)


def test_olmoe_does_not_split_over_ranks(moes):
    with pytest.raises(InvalidRequest, match="does not split over tensor-parallel ranks"):
        Engine(model=str(moes["olmoe"]), dtype="float32", kv_tokens=1024, tensor_parallel_size=2)
