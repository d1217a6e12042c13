"""Prompt logprobs (backend/scoring.py): each prompt token's logprob and top alternatives
equal HF transformers' on the same weights, whatever the chunking and the mode asked."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import scoring
from tokendance.backend.api import Delta, SamplingParams
from tokendance.backend.engine import Engine

K = 3


def run(eng: Engine, prompts: list[list[int]], sampling: SamplingParams, mode: str) -> list[list[Delta]]:
    ids = [f"r{i}" for i in range(len(prompts))]
    got: dict[str, list[Delta]] = {r: [] for r in ids}
    for rid, p in zip(ids, prompts):
        eng.add(rid, p, sampling, mode)
    while eng.has_work():
        for rid, d in eng.step():
            got[rid].append(d)
    return [got[r] for r in ids]


@pytest.mark.parametrize("budget,mode,rows", [(512, "full", 1024), (16, "full", 1024), (512, "collective", 1024),
                                              (512, "full", 8)],
                         ids=["whole", "chunked", "collective-asked", "few-rows-a-step"])
def test_prompt_logprobs_equal_hfs(tiny_llama, hf, monkeypatch, budget, mode, rows):
    monkeypatch.setattr(scoring, "ROWS", rows)  # the rows a step may score
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=budget)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, eng.mcfg.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 40)]
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=K)
    for p, deltas in zip(prompts, run(eng, prompts, sp, mode)):
        scored = deltas[0].prompt_logprobs
        assert scored is not None and len(scored) == len(p)
        assert (scored[0].token, scored[0].logprob, scored[0].top) == (eng.tokenizer.decode([p[0]]), None, [])
        assert all(d.prompt_logprobs is None for d in deltas[1:])  # on the first delta only
        with torch.no_grad():
            logp = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        for i in range(1, len(p)):
            t = scored[i]
            assert (t.token, t.id) == (eng.tokenizer.decode([p[i]]), p[i])
            assert t.logprob == pytest.approx(logp[i - 1, p[i]].item(), abs=1e-4)
            # 1 + how many tokens are likelier; one within float rounding of it may fall either side
            own = logp[i - 1, p[i]]
            lo, hi = (1 + (logp[i - 1] > own + tol).sum().item() for tol in (1e-5, -1e-5))
            assert lo <= t.rank <= hi and hi - lo < 5
            want = logp[i - 1].topk(K)
            assert [x.id for x in t.top] == want.indices.tolist()
            assert [x.token for x in t.top] == [eng.tokenizer.decode([j]) for j in want.indices.tolist()]
            assert [x.logprob for x in t.top] == pytest.approx(want.values.tolist(), abs=1e-4)


def test_without_them_nothing_is_scored(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)
    (deltas,) = run(eng, [[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0), "full")
    assert all(d.prompt_logprobs is None for d in deltas)
    (deltas,) = run(eng, [[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), "full")
    assert [t.top for t in deltas[0].prompt_logprobs[1:]] == [[], [], []]  # the token's own only


def test_a_step_scores_all_its_prompt_rows_in_chunks(tiny_llama, monkeypatch):
    def scored(rows: int) -> list[list]:
        monkeypatch.setattr(scoring, "ROWS", rows)  # rows of logits held at once
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_batched_tokens=512)
        for i, n in enumerate((25, 25)):
            eng.add(f"s{i}", list(range(3 + i, 3 + i + n)), SamplingParams(max_tokens=1, prompt_logprobs=2), "full")
        eng.add("plain", list(range(3, 40)), SamplingParams(max_tokens=1), "full")
        out = dict(eng.step())  # one step prefills all three and samples their first tokens
        assert set(out) == {"s0", "s1", "plain"} and out["plain"].prompt_logprobs is None
        return [out[s].prompt_logprobs for s in ("s0", "s1")]

    chunked, whole = scored(10), scored(1024)
    assert all(t is not None for p in chunked for t in p)
    assert [[(t.token, t.top) for t in p] for p in chunked] == [[(t.token, t.top) for t in p] for p in whole]
    assert [t.logprob for p in chunked for t in p[1:]] == pytest.approx([t.logprob for p in whole for t in p[1:]])


def test_pieces_are_what_decode_gives_each_token(tiny_llama):
    from transformers import AutoTokenizer

    from tokendance.backend.detok import Pieces

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    pieces = Pieces(tok)
    ids = list(range(0, len(tok), 7))
    assert pieces(ids) == [(tok.decode([i]), list(tok.decode([i]).encode())) for i in ids]
    assert pieces(ids[:3]) == pieces(ids)[:3] and len(pieces.known) == len(ids)  # decoded once each
