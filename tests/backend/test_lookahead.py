"""Decode steps that overlap host and GPU (backend/lookahead.py) change no output: on the
CPU the same lookahead logic runs eagerly (overlap=True), against overlap=False."""

from __future__ import annotations

import pytest

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine

from tests.backend.test_scheduling import prompts


def engine(model, overlap: bool, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", kv_tokens=kw.pop("kv_tokens", 4096),
                  overlap=overlap, **kw)


def play(eng: Engine, reqs: list[tuple[list[int], SamplingParams]], late: int = 0,
         abort: str | None = None) -> tuple[dict[str, tuple], int]:
    """Run requests to the end: the last `late` ones join after three steps, `abort` is
    aborted after five. Per request: (token ids, text, finish reason, usage, logprobs);
    and how many steps took their input ids from the device."""
    toks = {f"r{i}": [] for i in range(len(reqs))}
    text = {k: [] for k in toks}
    lps = {k: [] for k in toks}
    done: dict[str, tuple] = {}
    first = len(reqs) - late
    for i, (p, sp) in enumerate(reqs[:first]):
        eng.add(f"r{i}", p, sp)
    steps = chained = 0
    real = eng.runner.run

    def spy(work, ids=None):
        nonlocal chained
        chained += ids is not None
        return real(work, ids) if ids is not None else real(work)

    eng.runner.run = spy
    while eng.has_work():
        for rid, d in eng.step():
            toks[rid] += d.token_ids
            text[rid].append(d.text)
            lps[rid] += d.logprobs or []
            if d.finish_reason:
                done[rid] = (toks[rid], "".join(text[rid]), d.finish_reason, d.usage, lps[rid])
        steps += 1
        if steps == 3:
            for i, (p, sp) in enumerate(reqs[first:], first):
                eng.add(f"r{i}", p, sp)
        if steps == 5 and abort is not None:
            assert eng.abort(abort)
            done[abort] = ("aborted",)
    eng.runner.run = real
    assert eng.inflight is None and eng.pool.num_free == eng.cache.num_blocks
    return done, chained


def requests(ref: Engine, n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Mixed requests: lengths, limits, seeded sampling, and stops placed (from a first
    greedy run) to fire mid-generation: a stop token id, a stop string."""
    ps = prompts(n, seed)
    reqs = [(p, SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=True))
            for i, p in enumerate(ps)]
    first = ref.generate([ps[0], ps[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    reqs[0] = (ps[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                     stop_token_ids=[first[0][0][6]]))
    stop = first[1][1][len(first[1][1]) // 2:][:3]
    reqs[1] = (ps[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    reqs[2] = (ps[2], SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True))
    return reqs


@pytest.mark.parametrize("late", [0, 2])
def test_overlap_changes_no_output(tiny_llama, late):
    off, on = engine(tiny_llama, False), engine(tiny_llama, True)
    reqs = requests(off, 6, seed=31)
    want, none = play(off, reqs, late)
    got, chained = play(on, reqs, late)
    assert got == want
    assert none == 0 and chained > 10, "overlap on: decode steps took their ids from the device"
    assert want["r0"][2] == "stop" and len(want["r0"][0]) < 12  # the stops fired early
    assert want["r1"][2] == "stop" and len(want["r1"][0]) < 12


def test_overlap_with_abort_and_preemption(tiny_llama):
    """A request aborted while its token is in flight, and a pool so small that running
    sequences are preempted: the rest is unchanged and no block leaks."""
    small = dict(kv_tokens=16 * 14)
    off, on = engine(tiny_llama, False, **small), engine(tiny_llama, True, **small)
    preempted = []
    real = on.scheduler.preempt
    on.scheduler.preempt = lambda seq: preempted.append(seq.id) or real(seq)
    reqs = [(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in prompts(6, seed=2)]
    want, _ = play(off, reqs, abort="r1")
    got, chained = play(on, reqs, abort="r1")
    assert got == want and chained > 0
    assert preempted, "the pool was large enough: nothing was preempted"


def test_prefix_blocks_hash_the_tokens_that_landed(tiny_llama):
    """Full blocks are published for prefix caching only with read tokens: a second
    request extending the first's output hits the same blocks with or without overlap."""
    hits = {}
    for overlap in (False, True):
        eng = engine(tiny_llama, overlap)
        p = prompts(1, seed=33)[0][:40]
        sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        toks = eng.generate([p], sp, mode="prefix")[0][0]
        eng.add("again", p + toks + [5], SamplingParams(max_tokens=1, temperature=0), mode="prefix")
        while eng.has_work():
            for rid, d in eng.step():
                if d.usage:
                    hits[overlap] = d.usage.cached_tokens
    assert hits[True] == hits[False] >= 64


def test_logprobs_are_read_with_their_tokens(tiny_llama):
    """Requests that want log-probabilities decode without lookahead, unchanged."""
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    reqs = [(p, sp) for p in prompts(2, seed=34)]
    want, _ = play(engine(tiny_llama, False), reqs)
    got, chained = play(engine(tiny_llama, True), reqs)
    assert got == want and chained == 0
    assert all(len(r[4]) == 4 for r in got.values())
