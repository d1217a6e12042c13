"""Sliding windows in the engine: each layer reads its window (config.json's, by
transformers' rule for each architecture), a model's context is not capped at it, and
the engine gives HF's greedy tokens past it, prefill chunked across it and decode
leaving it behind; reuse holds as without one."""

from __future__ import annotations

import json

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
WIN = 40
LENGTHS = (3, 39, 64, 200, 333)


def matches_hf(folder, **kw) -> list:
    # chunks of 64 tokens: a prefill reads keys of earlier chunks across the window
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=64, **kw)
    prompts = prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=11)
    ours = eng.generate(prompts, GREEDY)
    for (toks, _, _), want in zip(ours, hf_greedy(folder, prompts, 24)):
        same_tokens(toks, want)
    assert eng.generate(prompts, GREEDY, mode="prefix") == ours  # the same blocks again, cached
    return ours


@pytest.fixture(scope="module")
def mistral(make_model):
    return make_model("mistral", sliding_window=WIN)


def test_mistral_past_its_window_matches_hf(mistral, monkeypatch):
    eng = Engine(model=str(mistral), dtype="float32", kv_tokens=8192)
    assert eng.mcfg.windows == (WIN, WIN) and eng.max_model_len == 4096  # the model's, not the window's
    ours = matches_hf(mistral)
    # the test can tell: attending to every key gives other tokens
    monkeypatch.setattr(ModelConfig, "window", lambda self, layer: 0)
    eng = Engine(model=str(mistral), dtype="float32", kv_tokens=8192, max_batched_tokens=64)
    assert eng.generate(prompts_for(eng.mcfg.vocab_size, LENGTHS, seed=11), GREEDY) != ours


def test_a_window_on_some_layers_only(make_model):
    """Qwen2's rule: layers from max_window_layers on slide, the ones before read all."""
    folder = make_model("qwen2", use_sliding_window=True, sliding_window=WIN, max_window_layers=1)
    assert ModelConfig.load(folder).windows == (0, WIN)
    matches_hf(folder)


def test_reuse_in_a_window(mistral):
    reuses_as_llama_does(mistral)


def test_windows_as_transformers_reads_them(tmp_path):
    def windows(arch: str, **over) -> tuple[int, ...]:
        raw = {"architectures": [arch], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 4, **over}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return ModelConfig.load(tmp_path).windows

    assert windows("MistralForCausalLM") == (4096,) * 4  # transformers' default
    assert windows("MistralForCausalLM", sliding_window=None) == ()
    assert windows("Phi3ForCausalLM", sliding_window=2047) == (2047,) * 4
    assert windows("Phi3ForCausalLM") == windows("LlamaForCausalLM", sliding_window=64) == ()
    assert windows("Qwen2ForCausalLM", sliding_window=64) == ()  # use_sliding_window is off by default
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=2) == (0, 0, 64, 64)
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64) == ()  # 28 layers full
    assert windows("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 2) == (8, 0, 8, 0)
    assert windows("Qwen2MoeForCausalLM", use_sliding_window=True, sliding_window=8, max_window_layers=3,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32) == (8, 0, 8, 0)
    assert windows("SmolLM3ForCausalLM", use_sliding_window=True, sliding_window=8) == (0, 0, 0, 8)
    for over, match in (({"sliding_window": 0.5}, "sliding_window"),
                        ({"sliding_window": True}, "sliding_window"),
                        ({"use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
                        ({"use_sliding_window": True, "layer_types": ["local"] * 4}, "layer_types"),
                        ({"use_sliding_window": True, "max_window_layers": "2"}, "max_window_layers")):
        with pytest.raises(InvalidRequest, match=match):
            windows("Qwen2ForCausalLM" if "use_sliding_window" in over else "MistralForCausalLM", **over)
