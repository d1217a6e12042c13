"""Shared segments shorter than the engine's minimum are computed as the request's own
tokens (backend/segments.py: min_shared): exact, and no Mirror where none is left."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.segments import min_shared
from tests.backend.test_reuse import round_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def engine(model, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", kv_tokens=8192, **kw)


def finish(eng: Engine, prompts, spans, mode: str):
    toks, usage = {i: [] for i in range(len(prompts))}, {}
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"{mode}-{i}", p, GREEDY, mode=mode, shared=sp)
    while eng.has_work():
        for rid, d in eng.step():
            i = int(rid.rsplit("-", 1)[1])
            toks[i] += d.token_ids
            usage[i] = d.usage or usage.get(i)
    return [toks[i] for i in range(len(prompts))], [usage[i] for i in range(len(prompts))]


def test_only_segments_of_the_minimum_length_are_reused(tiny_llama):
    eng = engine(tiny_llama, min_shared_tokens=33)
    prompts, spans = round_prompts(3, seed=41, out=30)  # outputs of 30, 33 and 36 tokens
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"r{i}", p, GREEDY, mode="collective", shared=sp)
        assert eng.seqs[f"r{i}"].shared == [(lo, hi) for lo, hi in sp if hi - lo >= 33]
    assert [len(eng.seqs[f"r{i}"].shared) for i in range(3)] == [2, 1, 1]


@pytest.mark.parametrize("mode", ["pic", "collective"])
def test_a_request_whose_segments_are_all_short_is_exact(tiny_llama, mode):
    prompts, spans = round_prompts(3, seed=42)
    outs, usage = finish(engine(tiny_llama, min_shared_tokens=1000), prompts, spans, mode)
    assert outs == finish(engine(tiny_llama), prompts, spans, "full")[0]
    assert all(u.shared_tokens == 0 and u.recomputed_tokens == 0 for u in usage)
    _, usage = finish(engine(tiny_llama, min_shared_tokens=0), prompts, spans, mode)
    assert all(u.shared_tokens > 0 for u in usage)  # the same segments, reused


@pytest.mark.device_defaults
def test_the_default_minimum_follows_the_device():
    assert min_shared(None, torch.device("cpu")) == 0
    assert min_shared(None, torch.device("cuda")) == 64
    assert min_shared(7, torch.device("cuda")) == 7 and min_shared(0, torch.device("cpu")) == 0
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(InvalidRequest, match="min_shared_tokens must be a non-negative integer"):
            min_shared(bad, torch.device("cpu"))
