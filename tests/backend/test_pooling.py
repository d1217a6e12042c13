"""Embeddings (backend/pooling.py): a prompt's last token's final hidden state equals HF
transformers' on the same weights (normalized, or raw), whatever the chunking, beside
requests that generate, and again from the prefix cache."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tokendance.backend.api import Delta, Pooling, SamplingParams
from tokendance.backend.engine import Engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(eng: Engine, jobs: list[tuple[list[int], Pooling | None]], mode: str = "collective") -> list[list[Delta]]:
    """Each job's deltas: a pooling request (with its Pooling), or a greedy generation."""
    for i, (prompt, pool) in enumerate(jobs):
        eng.add(f"r{i}", prompt, SamplingParams(max_tokens=1) if pool else GREEDY, mode, pool=pool)
    got: defaultdict[str, list[Delta]] = defaultdict(list)
    while eng.has_work():
        for rid, d in eng.step():
            got[rid].append(d)
    return [got[f"r{i}"] for i in range(len(jobs))]


def last_state(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]


def prompts(eng: Engine, lengths: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, eng.mcfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("budget", [512, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_an_embedding_is_hfs_last_hidden_state(tiny_llama, hf, budget, normalize):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=budget)
    ps = prompts(eng, (1, 9, 40))
    out = run(eng, [(p, Pooling(normalize)) for p in ps])
    for p, deltas in zip(ps, out):
        (d,) = deltas  # one delta: the vector, the usage, the end
        assert d.finish_reason == "stop" and d.token_ids == [] and d.text == ""
        assert d.usage.prompt_tokens == len(p) and d.usage.completion_tokens == 0
        ref = last_state(hf, p)
        ref = torch.nn.functional.normalize(ref, dim=-1) if normalize else ref
        got = torch.tensor(d.embedding)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), (got - ref).abs().max()
        if normalize:
            assert abs(got.norm().item() - 1) < 1e-5
    assert not eng.seqs and eng.pool.num_free == eng.cache.num_blocks


def test_embeddings_beside_generation_change_neither(tiny_llama, hf):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=64)
    gen, emb = prompts(eng, (12, 30), seed=5)
    alone = run(eng, [(gen, None)], "full")[0]
    both = run(eng, [(gen, None), (emb, Pooling()), (gen, None)], "full")
    tokens = [t for d in alone for t in d.token_ids]
    assert [t for d in both[0] for t in d.token_ids] == tokens
    assert [t for d in both[2] for t in d.token_ids] == tokens
    ref = torch.nn.functional.normalize(last_state(hf, emb), dim=-1)
    assert torch.allclose(torch.tensor(both[1][-1].embedding), ref, atol=1e-5)


def test_an_embedding_never_reuses_by_pic_and_repeats_from_the_prefix_cache(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)
    (p,) = prompts(eng, (70,), seed=7)
    eng.add("a", p, SamplingParams(max_tokens=1), "collective", shared=[(10, 60)], pool=Pooling())
    assert eng.seqs["a"].mode == "prefix" and not eng.waiting.seqs
    first = None
    while eng.has_work():
        for _, d in eng.step():
            first = d
    (second,) = run(eng, [(p, Pooling())])[0]
    assert second.usage.cached_tokens == 64  # four full blocks of 16, short of the last token
    assert torch.allclose(torch.tensor(second.embedding), torch.tensor(first.embedding), atol=1e-5)


def test_an_aborted_embedding_frees_its_blocks(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=16)
    (p,) = prompts(eng, (100,), seed=9)
    eng.add("a", p, SamplingParams(max_tokens=1), "full", pool=Pooling())
    eng.step()  # its first chunk
    assert eng.abort("a")
    assert not eng.has_work() and eng.pool.num_free == eng.cache.num_blocks
