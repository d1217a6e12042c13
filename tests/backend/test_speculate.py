"""N-gram speculation (backend/speculate.py, backend/ngram.py): the lookup, the config, greedy output unchanged
in every mode and under a short budget or a small pool, and sampled output's distribution
kept by the verification."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.ngram import Speculation, propose
from tokendance.backend.speculate import verify

from tests.backend.test_reuse import round_prompts
from tests.backend.test_scheduling import prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def engine(model, spec: dict | None = SPEC, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", kv_tokens=kw.pop("kv_tokens", 8192), speculative_config=spec,
                  **kw)


def play(eng: Engine, reqs: list[tuple[list[int], SamplingParams]], **add) -> dict[str, tuple]:
    """Run requests to the end: per request (token ids, finish reason, logprobs); no block left held."""
    got: dict[str, tuple] = {}
    toks = {f"r{i}": [] for i in range(len(reqs))}
    lps = {k: [] for k in toks}
    for i, (p, sp) in enumerate(reqs):
        eng.add(f"r{i}", p, sp, **{k: v[i] if isinstance(v, list) else v for k, v in add.items()})
    while eng.has_work():
        for rid, d in eng.step():
            toks[rid] += d.token_ids
            lps[rid] += [x.logprob for x in d.logprobs or []]
            if d.finish_reason:
                got[rid] = (toks[rid], d.finish_reason, lps[rid])
    return got


def same(a: dict[str, tuple], b: dict[str, tuple]) -> None:
    assert {k: v[:2] for k, v in a.items()} == {k: v[:2] for k, v in b.items()}
    for k in a:
        assert torch.allclose(torch.tensor(a[k][2]), torch.tensor(b[k][2]), atol=1e-4), k


@pytest.mark.parametrize("tokens,want", [
    ([1, 2, 3, 9, 1, 2, 3], [9, 1, 2]),  # the longest suffix that occurred: 1 2 3
    ([5, 2, 3, 7, 1, 2, 3, 8, 6, 2, 3], [7, 1, 2]),  # 2 3 occurred twice: the earliest
    ([4, 4, 4, 4], [4]),  # an occurrence may overlap the suffix; as many tokens as follow it
    ([1, 2, 3, 4], []),  # nothing recurs
    ([0x02000000, 0, 7, 2], []),  # 2's bytes occur off a token boundary: no match
])
def test_propose_takes_the_longest_then_earliest_match(tokens, want):
    assert propose(tokens, Speculation(3, 1, 3), room=10) == want


def test_propose_within_room_and_lookup_min():
    assert propose([1, 2, 3, 9, 8, 1, 2, 3], Speculation(4, 1, 3), room=2) == [9, 8]
    assert propose([1, 2, 3, 9, 8, 1, 2, 3], Speculation(4, 1, 3), room=0) == []
    assert propose([7, 9, 5, 9], Speculation(4, 2, 3), room=5) == []  # one token recurs, not two


@pytest.mark.parametrize("raw,want", [
    ({"num_speculative_tokens": 3}, Speculation(3, 5, 5)),  # vLLM's defaults
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, Speculation(2, 4, 4)),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 2}, Speculation(2, 2, 2)),
    (None, None),
])
def test_config(raw, want):
    assert Speculation.parse(raw) == want


@pytest.mark.parametrize("raw,msg", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "n-gram lookup alone"),
    ({"num_speculative_tokens": 3, "model": "x"}, "unknown field 'model'"),
    ({"prompt_lookup_max": 3}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 65}, "over 64"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be <="),
    ([3], "a JSON object"),
])
def test_bad_config_is_named(raw, msg):
    with pytest.raises(InvalidRequest, match=msg) as e:
        Speculation.parse(raw)
    assert e.value.param == "speculative_config"


def test_not_with_overlap(tiny_llama):
    with pytest.raises(InvalidRequest, match="not with overlap"):
        engine(tiny_llama, overlap=True)


def reqs_of(ps: list[list[int]], ref: Engine) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests, some with logprobs, one ended by a stop token and one by a stop string
    placed (from a first run) mid-output, where drafts run past them."""
    g = dict(temperature=0, ignore_eos=True)
    out = [(p, SamplingParams(max_tokens=24 + 5 * i, logprobs=i % 2 == 1, top_logprobs=2 * (i % 2), **g))
           for i, p in enumerate(ps)]
    first = ref.generate(ps[:2], SamplingParams(max_tokens=24, **g))
    out[0] = (ps[0], SamplingParams(max_tokens=24, stop_token_ids=[first[0][0][15]], **g))
    out[1] = (ps[1], SamplingParams(max_tokens=24, stop=[first[1][1][-12:-8]], **g))
    return out


def test_greedy_output_is_unchanged_and_drafts_are_kept(tiny_llama):
    off, on = engine(tiny_llama, None), engine(tiny_llama)
    reqs = reqs_of(prompts(6, seed=5), off)
    want = play(off, reqs)
    got = play(on, reqs)
    same(got, want)
    assert want["r0"][1] == want["r1"][1] == "stop" and len(want["r0"][0]) < 24  # the stops fired
    s = on.speculator
    assert s.drafts > 0 and 0 < s.accepted <= s.draft_tokens
    assert on.pool.num_free == on.cache.num_blocks


def test_steps_fewer_than_tokens(tiny_llama):
    """Accepted drafts save steps: the greedy loops a random model falls into recur."""
    eng = engine(tiny_llama)
    steps = 0
    eng.add("a", prompts(6, seed=5)[0], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while eng.has_work():
        eng.step()
        steps += 1
    assert steps < 60 - eng.speculator.accepted + 2


@pytest.mark.parametrize("mode", ["prefix", "pic", "collective"])
def test_every_mode_keeps_its_output(tiny_llama, mode):
    ps, spans = round_prompts(4, seed=9)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reqs = [(p, sp) for p in ps]
    want = play(engine(tiny_llama, None), reqs, mode=mode, shared=spans)
    on = engine(tiny_llama)
    same(play(on, reqs, mode=mode, shared=spans), want)
    assert on.speculator.accepted > 0


@pytest.mark.parametrize("pool,budget", [(8192, 3), (256, 160)])
def test_short_budget_and_small_pool(tiny_llama, pool, budget):
    """Drafts cut by the step's token budget, and sequences preempted while they have drafts."""
    ps = prompts(6, seed=5)  # the first loops after 18 tokens
    reqs = [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in ps[:1] * 3 + ps[3:]]
    small = dict(kv_tokens=pool, max_batched_tokens=budget)
    want = play(engine(tiny_llama, None, **small), reqs)
    on = engine(tiny_llama, **small)
    cut, real = [], on.runner.run
    on.runner.run = lambda work: cut.extend(w.samples and w.drafts < len(w.seq.draft) for w in work) or real(work)
    same(play(on, reqs), want)
    assert on.speculator.accepted > 0 and on.pool.num_free == on.cache.num_blocks
    assert any(cut) if budget == 3 else on.scheduler.preemptions > 0


def test_requests_that_need_each_token_decode_one_a_step(tiny_llama):
    """Penalties and min_tokens keep a request from drafting; its output is unchanged."""
    p = prompts(2, seed=5)
    reqs = [(p[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.3)),
            (p[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, min_tokens=30))]
    on = engine(tiny_llama)
    same(play(on, reqs), play(engine(tiny_llama, None), reqs))
    assert on.speculator.drafts == 0


def test_sampled_requests_finish(tiny_llama):
    """Seeded sampling with drafts: the same output for the same seed, each to its length."""
    reqs = [(p, SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3 + i, ignore_eos=True))
            for i, p in enumerate(prompts(3, seed=5))]
    a, b = play(engine(tiny_llama), reqs), play(engine(tiny_llama), reqs)
    assert a == b and all(len(v[0]) == 30 and v[1] == "length" for v in a.values())


def rows(p: torch.Tensor, n: int) -> torch.Tensor:
    return p.log().expand(n, -1)


def test_verification_keeps_the_distribution():
    """Speculative sampling with a draft of probability one: the first token follows the model's
    first row whatever the draft, and the second its second row when the draft was kept."""
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p2 = torch.tensor([0.5, 0.25, 0.15, 0.1])
    hot = SamplingParams(temperature=1.0)
    n = 20000
    g = torch.Generator().manual_seed(0)
    for draft in (1, 3):
        seqs = [SimpleNamespace(sampling=hot, generator=None, draft=[draft]) for _ in range(n)]
        logits = torch.stack([p1.log(), p2.log()]).repeat(n, 1)
        got = verify(logits, seqs, g)
        first = torch.bincount(torch.tensor([x[0].token for x in got]), minlength=4) / n
        assert torch.allclose(first, p1, atol=0.015), (draft, first)
        kept = [x[1].token for x in got if len(x) == 2]
        assert all(x[0].token == draft for x in got if len(x) == 2)
        second = torch.bincount(torch.tensor(kept), minlength=4) / len(kept)
        assert len(kept) == pytest.approx(n * p1[draft].item(), rel=0.05)
        assert torch.allclose(second, p2, atol=0.02), (draft, second)


def test_greedy_verification_keeps_the_argmax_prefix():
    cold = SamplingParams(temperature=0)
    logits = torch.eye(5)[[2, 4, 1, 0]] * 3  # argmaxes 2, 4, 1, 0
    seq = SimpleNamespace(sampling=cold, generator=None, draft=[2, 4, 3])
    assert [s.token for s in verify(logits, [seq], None)[0]] == [2, 4, 1]
    seq.draft = [2, 4, 1]
    assert [s.token for s in verify(logits, [seq], None)[0]] == [2, 4, 1, 0]


def test_metrics_count_drafts(tiny_llama):
    from tokendance.backend.service import EngineBackend

    def gauges(eng: Engine) -> dict[str, float]:
        backend = object.__new__(EngineBackend)  # its gauges read the engine alone
        backend.engine = eng
        return {g.name: g.value for g in backend.gauges()}

    eng = engine(tiny_llama)
    eng.generate(prompts(6, seed=5)[:1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    s, got = eng.speculator, gauges(eng)
    assert (got["spec_decode_num_drafts_total"], got["spec_decode_num_draft_tokens_total"],
            got["spec_decode_num_accepted_tokens_total"]) == (s.drafts, s.draft_tokens, s.accepted)
    assert s.accepted > 0
    assert not any(k.startswith("spec_decode") for k in gauges(engine(tiny_llama, None)))


def test_two_ranks_speculate_as_one_process(tiny_llama):
    """Tensor parallelism: every rank drafts and verifies alike (the ranks' digests agree),
    greedy output as one process gives it."""
    ps = prompts(6, seed=5)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reqs = [(ps[0], greedy), (ps[2], greedy),
            (ps[0], SamplingParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True))]
    want = play(engine(tiny_llama, device="cpu"), reqs)
    two = engine(tiny_llama, device="cpu", tensor_parallel_size=2)
    try:
        got = play(two, reqs)
    finally:
        two.close()
    assert two.tp.agreed and two.speculator.accepted > 0
    assert [got[r][0] for r in ("r0", "r1")] == [want[r][0] for r in ("r0", "r1")]
    assert len(got["r2"][0]) == 40
