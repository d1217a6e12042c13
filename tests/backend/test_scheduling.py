"""Continuous batching, preemption and abort change no output and leak no block."""

from __future__ import annotations

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 150, (n,), generator=g).tolist()
    return [torch.randint(3, 49152, (k,), generator=g).tolist() for k in lens]


def alone(folder, ps: list[list[int]]) -> list[list[int]]:
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=4096)
    return [eng.generate([p], GREEDY)[0][0] for p in ps]


def test_batch_equals_alone(tiny_llama):
    ps = prompts(7, seed=1)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=96)
    batched = [t for t, _, _ in eng.generate(ps, GREEDY)]
    assert batched == alone(tiny_llama, ps)
    assert eng.pool.num_free == eng.cache.num_blocks


def test_tiny_pool_preempts_without_changing_output(tiny_llama):
    ps = prompts(6, seed=2)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 14)  # 14 blocks
    res = eng.generate(ps, GREEDY)
    assert [t for t, _, _ in res] == alone(tiny_llama, ps)
    assert eng.pool.num_free == eng.cache.num_blocks


def test_preemption_happens(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 14)
    for i, p in enumerate(prompts(6, seed=2)):
        eng.add(f"r{i}", p, GREEDY)
    seen = 0
    while eng.has_work():
        eng.step()
        seen = max(seen, sum(s.preemptions for s in eng.seqs.values()))
    assert seen > 0


def test_abort_frees_every_block(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)
    ps = prompts(4, seed=3)
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add(f"r{i}", p, long)
    for _ in range(5):
        eng.step()
    assert eng.pool.num_free < eng.cache.num_blocks
    for i in range(4):
        assert eng.abort(f"r{i}")
    assert not eng.has_work()
    assert eng.pool.num_free == eng.cache.num_blocks
    assert not eng.abort("r0")


def test_sequence_longer_than_pool_finishes_with_length(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=64, max_model_len=4096)
    (toks, _, reason), = eng.generate([prompts(1, 4)[0][:40]], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert reason == "length" and 0 < len(toks) <= 24
    assert eng.pool.num_free == eng.cache.num_blocks


def test_prefix_cache_reuses_blocks_exactly(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)
    base = prompts(1, 5)[0] + prompts(1, 6)[0]
    other = base[:100] + [7, 8, 9]
    first = eng.generate([base], GREEDY, mode="prefix")[0][0]
    eng.add("x", other, GREEDY, mode="prefix")
    seq = eng.seqs["x"]
    out = []
    while eng.has_work():
        out += [t for _, d in eng.step() for t in d.token_ids]
    assert seq.cached == 96  # six full 16-token blocks of the shared 100-token prefix
    assert out == alone(tiny_llama, [other])[0]
    assert eng.generate([base], GREEDY, mode="prefix")[0][0] == first
