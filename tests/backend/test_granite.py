"""Granite: Llama's layers with four multipliers (the embeddings', each block output's
before its residual add, the attention scores', and the logits' divisor). The engine
gives HF's greedy tokens, in every reuse mode as for Llama."""

from __future__ import annotations

import json

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

# far from 1 (Granite 3's 2B: 12, 0.22, 1/64, 8), so a multiplier left out changes the tokens
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.5,
                   logits_scaling=2.0)


@pytest.fixture(scope="module")
def granite(make_model):
    return make_model("granite", pad_token_id=0, **MULTIPLIERS)


def engine(folder, monkeypatch, left_out: str | None = None) -> Engine:
    """An engine on `folder`, with one multiplier left at its Llama value."""
    if left_out is not None:
        load = ModelConfig.load.__func__

        def without(cls, f, overrides=None):
            cfg = load(cls, f, overrides)
            setattr(cfg, left_out, None if left_out == "attention_multiplier" else 1.0)
            return cfg

        monkeypatch.setattr(ModelConfig, "load", classmethod(without))
    return Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=512)


def top_logprobs(eng: Engine, prompt: list[int]) -> list[float]:
    eng.add("lp", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=3))
    (_, delta), = eng.step()
    return [t.logprob for t in delta.logprobs[0].top]


def test_granite_matches_hf(granite, monkeypatch):
    from transformers import AutoModelForCausalLM

    eng = engine(granite, monkeypatch)
    assert eng.mcfg.arch == "granite" and eng.mcfg.logits_scaling == 2.0
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 700), seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = eng.generate(prompts, greedy)
    for (toks, _, _), want in zip(ours, hf_greedy(granite, prompts, 24)):
        same_tokens(toks, want)
    assert eng.generate(prompts, greedy, mode="prefix") == ours
    hf = AutoModelForCausalLM.from_pretrained(granite, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompts[2]])).logits[0, -1].log_softmax(-1).topk(3).values.tolist()
    assert top_logprobs(eng, prompts[2]) == pytest.approx(want, abs=1e-4)
    # the test can tell: the tokens change with any multiplier of the layers left at 1, the
    # logprobs with the logits' divisor
    for name in MULTIPLIERS:
        other = engine(granite, monkeypatch, name)
        if name == "logits_scaling":
            assert top_logprobs(other, prompts[2]) != pytest.approx(want, abs=1e-2)
        else:
            assert other.generate(prompts, greedy) != ours, name


def test_granite_reuses_as_llama_does(granite):
    reuses_as_llama_does(granite)


def test_its_multipliers_are_read_as_transformers_reads_them(tmp_path):
    def config(**over) -> ModelConfig:
        raw = {"architectures": ["GraniteForCausalLM"], "vocab_size": 64, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, **over}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return ModelConfig.load(tmp_path)

    c = config()  # transformers' defaults: 1.0 each, the attention's too (not 1/sqrt(head_dim))
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling) == (1, 1, 1, 1)
    assert config(**MULTIPLIERS).attention_multiplier == 1.5
    assert config(architectures=["LlamaForCausalLM"], **MULTIPLIERS).attention_multiplier is None
    for bad in (0, -1.0, "8", True, None):
        with pytest.raises(InvalidRequest, match="logits_scaling must be a positive number"):
            config(logits_scaling=bad)
