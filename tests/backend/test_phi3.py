"""Phi-3 (3, 3.5, 4-mini): q, k, v and gate, up fused in the checkpoint, LongRoPE, and
(4-mini) RoPE on only part of each head. The loader splits the fused tensors and pairs
a head's dims up so that the kernels' RoPE turns the ones HF turns (the others at zero
frequency); LongRoPE takes its long factors where the server's context passes
original_max_position_embeddings (vLLM's choice), its short ones within it. The engine
gives HF's greedy tokens."""

from __future__ import annotations

import json

import pytest

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

HALF = [1.0, 1.5, 2.5, 4.0]  # a factor a turned pair: 4 pairs of 8 turned dims
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=HALF, long_factor=[f * 3 for f in HALF],
                attention_factor=1.5)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def phi3(make_model, share: float = 1.0, rope: dict | None = None, orig: int = 2048, **over):
    rope = dict(rope or {"rope_type": "default", "rope_theta": 10000.0}, partial_rotary_factor=share)
    if share == 1.0 and "short_factor" in rope:
        rope.update(short_factor=HALF * 2, long_factor=[f * 3 for f in HALF * 2])
    return make_model("phi3", pad_token_id=0, rope_parameters=rope, original_max_position_embeddings=orig,
                      max_position_embeddings=65536, **over)


@pytest.fixture(scope="module")
def mini4(make_model):
    """Phi-4-mini's kind: half of each head turned (its share is 3/4), LongRoPE."""
    return phi3(make_model, 0.5, LONGROPE)


def matches_hf(folder, lengths=(3, 17, 64, 200, 700), **over) -> tuple[Engine, list]:
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=512, **over)
    prompts = prompts_for(eng.mcfg.vocab_size, lengths, seed=7)
    ours = eng.generate(prompts, GREEDY)
    for (toks, _, _), want in zip(ours, hf_greedy(folder, prompts, 24)):
        same_tokens(toks, want)
    return eng, ours


def test_part_of_each_head_turned_with_longrope_matches_hf(mini4, monkeypatch):
    eng, ours = matches_hf(mini4, max_model_len=2048)  # within the short factors' reach
    assert (eng.mcfg.arch, eng.mcfg.rotary_dim, eng.mcfg.long_rope) == ("phi3", 8, False)
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 700), seed=7)
    assert eng.generate(prompts, GREEDY, mode="prefix") == ours
    # the test can tell: without the pairing, or without the attention factor folded in
    for broken in (lambda w, d, r, fold: w, lambda w, d, r, fold, pairs=loader._pairs: pairs(w, d, r, 1.0)):
        monkeypatch.setattr(loader, "_pairs", broken)
        broken = Engine(model=str(mini4), dtype="float32", kv_tokens=8192, max_model_len=2048)
        assert broken.generate(prompts, GREEDY) != ours
        monkeypatch.undo()


@pytest.mark.parametrize("kind", ["longrope", "plain"])
def test_whole_heads_turned_match_hf(make_model, kind):
    """Phi-3.5-mini's kind (LongRoPE) and Phi-3-mini-4k's (none)."""
    eng, _ = matches_hf(phi3(make_model, 1.0, LONGROPE if kind == "longrope" else None), max_model_len=2048)
    assert eng.mcfg.rotary_dim is None and eng.max_model_len == 2048 and not eng.mcfg.long_rope


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_longrope_past_its_original_reach_takes_the_long_factors(make_model, monkeypatch, share):
    """Phi-3.5-mini's and Phi-4-mini's 128 k context: served past original_max_position_embeddings
    (here 64; by default, as vLLM serves them, up to max_position_embeddings), every position
    turns by the long factors, as HF turns a sequence longer than that. The short ones give
    other tokens there."""
    folder = phi3(make_model, share, LONGROPE, orig=64)
    lengths = (65, 130, 300)
    eng, ours = matches_hf(folder, lengths)
    assert eng.mcfg.long_rope and eng.max_model_len == 8192  # the pool's
    with pytest.raises(InvalidRequest, match="context is 64 tokens"):
        Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_model_len=64).generate(
            prompts_for(eng.mcfg.vocab_size, (65,), seed=7), GREEDY)
    monkeypatch.setattr(ModelConfig, "reach", lambda self, n: self)  # the short factors, uncapped
    monkeypatch.setattr(ModelConfig, "context", property(lambda self: self.max_position))
    short = Engine(model=str(folder), dtype="float32", kv_tokens=8192)
    assert not short.mcfg.long_rope and short.generate(prompts_for(eng.mcfg.vocab_size, lengths, seed=7),
                                                       GREEDY) != ours


def test_a_sliding_window_does_not_cap_the_context(make_model):
    """Phi-3-mini-4k's kind: every layer attends within its sliding window (HF's 2047
    there), past which the context goes on."""
    eng, _ = matches_hf(phi3(make_model, sliding_window=100))
    assert eng.mcfg.windows == (100, 100) and eng.max_model_len == 8192  # the pool's


def test_phi3_reuses_as_llama_does(mini4):
    reuses_as_llama_does(mini4)


def test_what_cannot_be_read_is_a_one_line_error(tmp_path):
    def config(**over) -> None:
        raw = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, **over}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        return ModelConfig.load(tmp_path)

    assert config(partial_rotary_factor=0.75).rotary_dim == 12
    for share in (0.0, 0.1, 1.5, "half"):
        with pytest.raises(InvalidRequest, match="partial_rotary_factor"):
            config(partial_rotary_factor=share)
    from tokendance.backend.rope_scaling import rotary

    su = {"type": "su", "short_factor": HALF * 2, "long_factor": HALF * 2}
    assert config(rope_scaling=su, original_max_position_embeddings=2048, max_position_embeddings=4096
                  ).reach(0).long_rope
    assert not config(rope_scaling=su, original_max_position_embeddings=2048, max_position_embeddings=4096
                      ).reach(2048).long_rope
    with pytest.raises(InvalidRequest, match="long_factor"):
        rotary(config(rope_scaling=dict(su, long_factor=[1.0]), original_max_position_embeddings=2048,
                      max_position_embeddings=4096).reach(0))
    for rope, orig, match in (({"rope_type": "longrope", "short_factor": [1.0]}, 2048, "short_factor"),
                              ({"type": "su", "short_factor": HALF * 2}, None, "original_max_position_embeddings")):
        with pytest.raises(InvalidRequest, match=match):
            rotary(config(rope_scaling=rope, original_max_position_embeddings=orig))
