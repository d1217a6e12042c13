"""Gemma 2 (2B, 9B, 27B): Gemma 3's layer (norms before and after attention and MLP that
scale by 1 + weight, GeGLU, query_pre_attn_scalar, scaled embeddings) without q and k
norms, one RoPE, sliding windows on every other layer, and attention scores capped:
s -> cap * tanh(s / cap) (attn_logit_softcapping), as the logits are. Every prompt token's
logprob, fresh, chunked and decoded, equals HF's where the cap bends the scores."""

from __future__ import annotations

import json

import pytest
import torch

from tokendance.backend import families
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

LENGTHS = (3, 17, 70, 200)
# HF's only attention that caps scores: transformers 5.17 (the GPU host's) takes SDPA by
# default and leaves them uncapped; 5.25 refuses SDPA for Gemma 2
EAGER = "eager"


@pytest.fixture(scope="module")
def gemma(make_model):
    """Three layers: sliding (window 24), full, sliding; scores capped at 1 (random
    weights' scores are a few units: a cap of 50 would leave them as they are)."""
    return make_model("gemma2", num_hidden_layers=3, sliding_window=24, attn_logit_softcapping=1.0,
                      final_logit_softcapping=5.0)


@pytest.fixture(scope="module")
def hf(gemma):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32, attn_implementation=EAGER).eval()


def scored(folder, budget: int, out: int = 12) -> tuple[list[list[int]], list[list[float]]]:
    """`scoring`'s, of LENGTHS' prompts, budget tokens a step."""
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=budget)
    return scoring(eng, prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=5), out)


def scoring(eng: Engine, prompts: list[list[int]], out: int) -> tuple[list[list[int]], list[list[float]]]:
    """(prompt + greedy tokens, the logprob of every token after the first: the prompt's
    scored in prefill, the output's as sampled) of each prompt."""
    sp = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    toks, lps = [list(p) for p in prompts], [[] for _ in prompts]
    for i, p in enumerate(prompts):
        eng.add(f"r{i}", p, sp)
    while eng.has_work():
        for rid, d in eng.step():
            i = int(rid[1:])
            if d.prompt_logprobs is not None:
                lps[i] += [t.logprob for t in d.prompt_logprobs[1:]]
            toks[i] += d.token_ids
            lps[i] += [t.logprob for t in d.logprobs or []]
    return toks, lps


def hf_logprobs(hf, toks: list[int]) -> list[float]:
    with torch.no_grad():
        logp = hf(torch.tensor([toks])).logits[0].float().log_softmax(-1)
    return logp[torch.arange(len(toks) - 1), torch.tensor(toks[1:])].tolist()


@pytest.mark.parametrize("budget", [512, 64], ids=["whole", "chunked"])
def test_logprobs_equal_hfs(gemma, hf, budget):
    cfg = ModelConfig.load(gemma)
    assert (cfg.arch, cfg.windows, cfg.attn_softcap, cfg.logit_softcap, cfg.qk_norm, cfg.sandwich) == (
        "gemma2", (24, 0, 24), 1.0, 5.0, None, True)
    toks, lps = scored(gemma, budget)
    for t, lp in zip(toks, lps):
        assert lp == pytest.approx(hf_logprobs(hf, t), abs=1e-4)


def test_greedy_matches_hf(gemma):
    eng = Engine(model=str(gemma), dtype="float32", kv_tokens=8192, max_batched_tokens=64)
    prompts = prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=5)
    got = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for (toks, _, _), want in zip(got, hf_greedy(gemma, prompts, 24, EAGER)):
        same_tokens(toks, want)


@pytest.mark.parametrize("broken", ["no cap", "no window"])
def test_the_logprobs_see_each_part(gemma, monkeypatch, broken):
    """The test above can tell: without the score cap, or the window, they move."""
    toks, want = scored(gemma, 64, out=1)
    real = families.gemma
    if broken == "no cap":
        monkeypatch.setattr(families, "gemma", lambda raw, arch, path: {**real(raw, arch, path),
                                                                           "attn_softcap": None})
    else:
        monkeypatch.setattr(ModelConfig, "window", lambda self, layer: 0)
    _, got = scored(gemma, 64, out=1)
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) > 1e-2


def test_reuses_as_llama_does(gemma):
    reuses_as_llama_does(gemma)


def test_its_config_as_transformers_reads_it(tmp_path):
    def load(**over) -> ModelConfig:
        raw = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 5, "num_attention_heads": 4, **over}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return ModelConfig.load(tmp_path)

    cfg = load(query_pre_attn_scalar=144)  # transformers' defaults for the rest
    assert (cfg.windows, cfg.attn_softcap, cfg.logit_softcap, cfg.tie_embeddings) == ((4096, 0) * 2 + (4096,),
                                                                                      50.0, 30.0, True)
    assert (cfg.rope["rope_theta"], cfg.rope_local, cfg.attention_multiplier, cfg.embedding_multiplier) == (
        10000.0, None, 144 ** -0.5, 8.0)
    assert load(layer_types=["full_attention"] * 4 + ["sliding_attention"]).windows == (0,) * 4 + (4096,)
    assert load(attn_logit_softcapping=None, final_logit_softcapping=None).attn_softcap is None
    for over, match in (({"attn_logit_softcapping": -1}, "attn_logit_softcapping"),
                        ({"hidden_activation": "silu"}, "hidden_activation"),
                        ({"use_bidirectional_attention": True}, "use_bidirectional_attention")):
        with pytest.raises(InvalidRequest, match=match):
            load(**over)
