"""The CPU engine's decode over held rotated keys (kernels/rotated.py): the same greedy
tokens as gathering every step, for plain sequences and for a collective round's
Mirrors; held only while something decodes."""

from __future__ import annotations

import torch

from tests.backend.test_reuse import round_prompts
from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.kernels import rotated

GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def appends(monkeypatch) -> list[int]:
    calls = []
    real = rotated._append
    monkeypatch.setattr(rotated, "_append", lambda *a: calls.append(1) or real(*a))
    return calls


def twice(folder, monkeypatch, *args, **kw) -> tuple[list, list, int]:
    """(tokens with held keys, tokens gathering every step, appends made)."""
    calls = appends(monkeypatch)
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192)
    held = eng.generate(*args, **kw)
    assert not eng.runner.rotated.held  # released once nothing decodes
    made = len(calls)
    eng.runner.rotated.budget = 0
    gathered = eng.generate(*args, **kw)
    assert len(calls) == made  # nothing held within no budget
    return held, gathered, made


def test_plain_sequences(tiny_llama, monkeypatch):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 70, 33, 140)]
    held, gathered, made = twice(tiny_llama, monkeypatch, prompts, GREEDY)
    assert held == gathered
    assert made > 0


def test_collective_round_mirrors(tiny_llama, monkeypatch):
    prompts, spans = round_prompts(4, seed=9)
    held, gathered, made = twice(tiny_llama, monkeypatch, prompts, GREEDY, mode="collective", shared=spans)
    assert held == gathered
    assert made > 0


def test_budget_is_the_pools_bytes(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024)
    assert eng.runner.rotated is not None and eng.runner.rotated.budget == eng.cache.nbytes


def test_requests_joining_and_leaving_mid_decode(tiny_llama, monkeypatch):
    """Decodes beside another request's chunked prefill (mixed steps, which hold nothing),
    then a batch that gains it and loses the others one by one: every token is what
    gathering every step gives."""
    calls = appends(monkeypatch)
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (12, 40)]
    late = torch.randint(3, 49152, (300,), generator=g).tolist()

    def run(budget: int | None) -> dict[str, list[int]]:
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, max_batched_tokens=64)
        if budget is not None:
            eng.runner.rotated.budget = budget
        out: dict[str, list[int]] = {}
        for i, p in enumerate(first):
            eng.add(f"a{i}", p, SamplingParams(max_tokens=10 + 8 * i, temperature=0, ignore_eos=True))
        steps = 0
        while eng.has_work():
            if steps == 4:  # two sequences decoding: the late one's prefill takes 5 chunks
                eng.add("late", late, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for rid, d in eng.step():
                out.setdefault(rid, []).extend(d.token_ids)
            steps += 1
        return out

    held = run(None)
    made = len(calls)
    assert made > 0
    assert held == run(0)
    assert [len(held[k]) for k in ("a0", "a1", "late")] == [10, 18, 12]
