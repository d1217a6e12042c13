"""OLMo 2: each block's output normed before its residual add, no norm before it, and q and
k normed over all their heads at once. The engine gives HF's greedy tokens, and reuses
as for Llama (the check layer's selective recompute runs the same layer parts)."""

from __future__ import annotations

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine

from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens
from .test_reuse import reuses_as_llama_does


@pytest.fixture(scope="module")
def olmo2(make_model):
    return make_model("olmo2", num_hidden_layers=3, pad_token_id=0)


def test_olmo2_matches_hf(olmo2):
    eng = Engine(model=str(olmo2), dtype="float32", kv_tokens=8192, max_batched_tokens=512)
    assert (eng.mcfg.arch, eng.mcfg.qk_norm, eng.mcfg.post_norm) == ("olmo2", "all", True)
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 700), seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = eng.generate(prompts, greedy)
    for (toks, _, _), want in zip(ours, hf_greedy(olmo2, prompts, 24)):
        same_tokens(toks, want)
    variants = prompts + [p[: len(p) // 2] + [5, 6, 7] for p in prompts]
    full = eng.generate(variants, greedy)
    assert eng.generate(variants, greedy, mode="prefix") == eng.generate(variants, greedy, mode="prefix") == full


def test_olmo2_reuses_as_llama_does(olmo2):
    reuses_as_llama_does(olmo2)


def test_olmo2_does_not_split_over_ranks(olmo2):
    with pytest.raises(InvalidRequest, match="does not split over tensor-parallel ranks"):
        Engine(model=str(olmo2), dtype="float32", kv_tokens=1024, tensor_parallel_size=2)
