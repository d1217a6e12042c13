"""`--kv-cache-dtype fp8`: the pool holds K/V in 8-bit floats (kernels/fp8.py), a quarter of
float32's bytes a token; the engine computes as with a pool of the model's dtype that held
those 8-bit values, in every mode, parks and restores them bytewise."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import model as model_mod
from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.flags import add_engine_args
from tokendance.kernels.fp8 import narrow

from .test_gemma2 import scoring
from .test_greedy_vs_hf import prompts_for
from .test_idle import next_round, run
from .test_reuse import GREEDY, kv_of, prefill, round_prompts

def engine(folder, **kw) -> Engine:
    return Engine(model=str(folder), dtype="float32", kv_tokens=4096, **kw)


def scored(eng: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's tokens and greedy ones, and the logprob of every token after its first
    (the prompt's in chunks of the step budget, each chunk reading the ones before from the
    pool; the output's in decode steps)."""
    return scoring(eng, prompts, 8)


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def test_the_pool_holds_8_bit_floats(tiny_llama):
    auto, e4, e5 = (engine(tiny_llama, kv_cache_dtype=k) for k in ("auto", "fp8", "fp8_e5m2"))
    assert (e4.cache.kv.dtype, e5.cache.kv.dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert e4.cache.dtype == auto.cache.kv.dtype == torch.float32  # K/V computed in the model's dtype
    assert auto.kv_bytes_per_token == 4 * e4.kv_bytes_per_token == 4 * e5.kv_bytes_per_token
    assert auto.cache.nbytes == 4 * e4.cache.nbytes
    if auto.runner.rotated is not None:  # the CPU's held decode keys (float32): a model-dtype pool's budget
        assert e4.runner.rotated.budget == auto.runner.rotated.budget == auto.cache.nbytes
    with pytest.raises(InvalidRequest, match="unsupported kv cache dtype 'int4'; choose one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int4").dtype_on(torch.device("cpu"))
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"


def test_an_8_bit_pool_computes_as_a_wide_pool_holding_its_values(tiny_llama, monkeypatch):
    """Chunked prefill and decode read the pool: an 8-bit one gives the logprobs and tokens
    of a float32 pool into which every K/V went rounded to 8 bits (reads cast up, exactly).
    The rounding shows (against a float32 pool) and the coarser format strays further."""
    lengths = (70, 150, 230)
    prompts = prompts_for(49152, lengths, seed=3)
    kw = dict(max_batched_tokens=64)
    plain = scored(engine(tiny_llama, **kw), prompts)
    e4 = scored(engine(tiny_llama, kv_cache_dtype="fp8", **kw), prompts)
    e5 = scored(engine(tiny_llama, kv_cache_dtype="fp8_e5m2", **kw), prompts)
    real = model_mod.store

    def rounded(k, v, *a, **kw):
        return real(narrow(k, torch.float8_e4m3fn).float(), narrow(v, torch.float8_e4m3fn).float(), *a, **kw)

    monkeypatch.setattr(model_mod, "store", rounded)
    wide = scored(engine(tiny_llama, **kw), prompts)
    assert e4[0] == wide[0] and gap(e4[1], wide[1]) < 1e-5
    assert 1e-4 < gap(e4[1], plain[1]) < gap(e5[1], plain[1])


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_collective_equals_pic_in_an_8_bit_pool(tiny_llama, kv):
    eng = engine(tiny_llama, kv_cache_dtype=kv)
    prompts, spans = round_prompts(4, seed=1)
    pic, pic_logits = prefill(eng, "pic", prompts, spans)
    pic_kv = [kv_of(eng, s).float() for s in pic]
    col, col_logits = prefill(eng, "collective", prompts, spans)
    for a, b, ka in zip(pic, col, pic_kv):
        assert a.recomputed == b.recomputed > 0
        torch.testing.assert_close(kv_of(eng, b).float(), ka, rtol=0, atol=0)
    torch.testing.assert_close(col_logits, pic_logits, rtol=1e-4, atol=1e-4)
    for s in pic + col:
        eng.abort(s.id)
    for m in ("full", "prefix"):
        assert all(len(t) == 10 for t, _, _ in eng.generate(prompts, GREEDY, mode=m, shared=spans))


@pytest.mark.parametrize("mode", ["kvcomm", "kvcmas"])
def test_anchored_rounds_read_base_plus_offset_from_an_8_bit_pool(tiny_llama, mode):
    """The second round of the same agents reads its segments as base + predicted offset,
    computed in the model's dtype and held rounded to 8 bits."""
    eng, agents = engine(tiny_llama, kv_cache_dtype="fp8"), ["a", "b", "c"]
    for seed in (6, 7):  # other outputs, the same lengths
        prompts, spans = round_prompts(3, seed=seed)
        out = eng.generate(prompts, GREEDY, mode=mode, shared=spans, agents=agents)
        assert all(len(t) == 10 for t, _, _ in out)
    assert eng.collector.anchored[mode].predicted > 0


def test_a_parked_agent_comes_back_bytewise(tiny_llama):
    """An agent whose first turn left the pool restores it from the host: the same tokens
    as when its blocks were still in the pool (the 8-bit bytes copied both ways)."""
    prompts = [round_prompts(2, seed=4)[0][i][:50 + 9 * i] for i in range(2)]
    spans = [[], []]
    outs = {}
    for pooled in (True, False):
        eng = engine(tiny_llama, kv_cache_dtype="fp8")
        first, _ = run(eng, prompts, spans, "collective", "r1-")
        nxt, _ = next_round(prompts, spans, first, seed=5, n_new=0)
        if not pooled:
            eng.pool.forget()
        restored = eng.idle.restored
        outs[pooled], _ = run(eng, nxt, spans, "collective", "r2-")
        assert (eng.idle.restored > restored) is not pooled
    assert outs[True] == outs[False]
