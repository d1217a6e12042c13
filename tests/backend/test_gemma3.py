"""Gemma 3 (text: 270M, 1B): norms before and after attention and MLP that scale by
1 + weight, GeGLU, q and k normed per head, scores scaled by query_pre_attn_scalar,
embeddings by the square root of the width, sliding windows on all but every sixth
layer with their own RoPE base. The engine gives HF's greedy tokens past the window."""

from __future__ import annotations

import json

import pytest

from tokendance.backend import families
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LENGTHS = (3, 17, 64, 200, 333)


@pytest.fixture(scope="module")
def gemma(make_model):
    """Three layers: sliding (window 24), full, sliding."""
    return make_model("gemma3", num_hidden_layers=3, sliding_window=24, sliding_window_pattern=2)


def ours(folder, **kw) -> list:
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=64, **kw)
    return eng.generate(prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=5), GREEDY)


def test_matches_hf(gemma):
    cfg = ModelConfig.load(gemma)
    assert (cfg.arch, cfg.windows, cfg.sandwich, cfg.act, cfg.qk_norm) == ("gemma3", (24, 0, 24), True,
                                                                           "gelu_tanh", "head")
    eng = Engine(model=str(gemma), dtype="float32", kv_tokens=8192, max_batched_tokens=64)
    prompts = prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=5)
    got = eng.generate(prompts, GREEDY)
    for (toks, _, _), want in zip(got, hf_greedy(gemma, prompts, 24)):
        same_tokens(toks, want)
    assert eng.generate(prompts, GREEDY, mode="prefix") == got


@pytest.mark.parametrize("broken", ["one rope", "llama norms", "head-dim scale", "no window"])
def test_each_part_shows_in_the_tokens(gemma, monkeypatch, broken):
    """The test above can tell: leave out any one of Gemma's parts and the tokens change."""
    want = ours(gemma)
    real = families.gemma

    def changed(raw, arch, path):
        out = real(raw, arch, path)
        if broken == "one rope":
            out["rope_local"] = None
        elif broken == "llama norms":
            out["norm_offset"] = False
        elif broken == "head-dim scale":
            out["attention_multiplier"] = None
        return out

    monkeypatch.setattr(families, "gemma", changed)
    if broken == "no window":
        monkeypatch.setattr(ModelConfig, "window", lambda self, layer: 0)
    assert ours(gemma) != want


def test_final_logit_softcapping(make_model):
    """Gemma 2's cap on the logits, which a Gemma 3 config may set: greedy cannot see it
    (tanh keeps the order), the logprobs do."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = make_model("gemma3", sliding_window=16, final_logit_softcapping=2.0)
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192)
    prompt = prompts_for(eng.mcfg.vocab_size, (70,), seed=9)[0]
    eng.add("lp", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=3))
    (_, delta), = eng.step()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1).topk(3).values.tolist()
    assert eng.mcfg.logit_softcap == 2.0 and max(want) < -8  # capped: near the uniform -10.8
    assert [t.logprob for t in delta.logprobs[0].top] == pytest.approx(want, abs=1e-4)


def test_reuses_as_llama_does(gemma):
    reuses_as_llama_does(gemma)


def test_what_it_cannot_read_is_a_one_line_error(tmp_path):
    def load(**over) -> ModelConfig:
        raw = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 7, "num_attention_heads": 4, **over}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return ModelConfig.load(tmp_path)

    cfg = load(rope_theta=5e5, rope_local_base_freq=2e4, query_pre_attn_scalar=64)
    assert cfg.windows == (4096,) * 5 + (0, 4096) and cfg.tie_embeddings  # transformers' defaults
    assert (cfg.rope["rope_theta"], cfg.rope_local["rope_theta"], cfg.attention_multiplier) == (5e5, 2e4, 0.125)
    assert load(rope_scaling={"rope_type": "linear", "factor": 8.0}).rope["factor"] == 8.0  # the global layers'
    assert (cfg.attn_softcap, load(attn_logit_softcapping=50.0).attn_softcap) == (None, 50.0)  # as Gemma 2's
    for over, match in (({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                        ({"hidden_activation": "silu"}, "hidden_activation"),
                        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
                        ({"final_logit_softcapping": "x"}, "final_logit_softcapping"),
                        ({"sliding_window_pattern": 0}, "sliding_window_pattern")):
        with pytest.raises(InvalidRequest, match=match):
            load(**over)
