"""SmolLM3: Llama's layers, some without RoPE (NoPE). Those layers rotate by the identity
(all angles zero), so the kernels, the CPU's held keys and every reuse mode run as for
any other layer; the engine gives HF's greedy tokens."""

from __future__ import annotations

import json

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does

FLAGS = [1, 0, 1]  # transformers' no_rope_layers: layer 1 takes no RoPE


@pytest.fixture(scope="module")
def smollm3(make_model):
    return make_model("smollm3", num_hidden_layers=3, no_rope_layers=FLAGS, pad_token_id=0)


def test_smollm3_matches_hf(smollm3, monkeypatch):
    eng = Engine(model=str(smollm3), dtype="float32", kv_tokens=8192, max_batched_tokens=512)
    assert eng.mcfg.arch == "smollm3" and eng.mcfg.nope == (1,)
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 700), seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = eng.generate(prompts, greedy)
    ref = hf_greedy(smollm3, prompts, 24)
    for (toks, _, _), want in zip(ours, ref):
        same_tokens(toks, want)
    variants = prompts + [p[: len(p) // 2] + [5, 6, 7] for p in prompts]
    full = eng.generate(variants, greedy)
    assert eng.generate(variants, greedy, mode="prefix") == eng.generate(variants, greedy, mode="prefix") == full
    # the test can tell: with RoPE in every layer (a Llama of the same weights) the tokens differ
    load = ModelConfig.load.__func__

    def as_llama(cls, folder, overrides=None):
        cfg = load(cls, folder, overrides)
        cfg.nope = ()
        return cfg

    monkeypatch.setattr(ModelConfig, "load", classmethod(as_llama))
    llama = Engine(model=str(smollm3), dtype="float32", kv_tokens=8192, max_batched_tokens=512)
    assert llama.mcfg.nope == () and llama.generate(prompts, greedy) != ours


def test_smollm3_reuses_as_llama_does(smollm3):
    reuses_as_llama_does(smollm3)


def _config(tmp_path, **over) -> ModelConfig:
    raw = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 8, "num_attention_heads": 4, **over}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.load(tmp_path)


def test_its_nope_layers_are_read_as_transformers_reads_them(tmp_path):
    assert _config(tmp_path).nope == (3, 7)  # every fourth, the default
    assert _config(tmp_path, no_rope_layer_interval=2).nope == (1, 3, 5, 7)
    assert _config(tmp_path, no_rope_layers=[0, 1, 1, 1, 1, 1, 1, 0]).nope == (0, 7)
    assert _config(tmp_path, architectures=["LlamaForCausalLM"], no_rope_layers=[0] * 8).nope == ()
    for bad in ({"no_rope_layers": [1, 0]}, {"no_rope_layers": [2] * 8}, {"no_rope_layers": "all"},
                {"no_rope_layer_interval": 0}):
        with pytest.raises(InvalidRequest, match="no_rope_layer"):
            _config(tmp_path, **bad)
