"""Idle agents: a finished request's KV is parked in the host tier and its agent's next
request restores the prefix they share instead of prefilling it (backend/idle.py)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tests.backend.test_reuse import round_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def engine(model, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", kv_tokens=8192, **kw)


def run(eng: Engine, prompts, spans, mode: str, tag: str, agents: bool = True):
    """Greedy outputs and usage of one round, each request sent as agent a<i>."""
    usage, toks = {}, {f"{tag}{i}": [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"{tag}{i}", p, GREEDY, mode=mode, shared=sp, agent=f"a{i}" if agents else None)
    while eng.has_work():
        for rid, d in eng.step():
            toks[rid] += d.token_ids
            if d.usage:
                usage[rid] = d.usage
    keys = [f"{tag}{i}" for i in range(len(prompts))]
    return [toks[k] for k in keys], [usage[k] for k in keys]


def next_round(prompts, spans, outs, seed: int, n_new: int = 2, size: int = 20):
    """Each agent's next prompt: its last one, its answer, then `n_new` new shared
    outputs (the same for every agent) and a private tail; the old spans stay shared."""
    g = torch.Generator().manual_seed(seed)
    new = [torch.randint(3, 49152, (size + 3 * k,), generator=g).tolist() for k in range(n_new)]
    out_p, out_s = [], []
    for p, sp, o in zip(prompts, spans, outs):
        ids = p + o + [11]
        sp = list(sp)
        for seg in new:
            sp.append((len(ids), len(ids) + len(seg)))
            ids += seg + [11]
        out_p.append(ids + [12, 13])
        out_s.append(sp)
    return out_p, out_s


def free_blocks_after_reset(eng: Engine) -> bool:
    eng.reset_caches()
    return eng.pool.num_free == eng.cache.num_blocks and eng.idle.bytes == 0


@pytest.mark.parametrize("mode", ["collective", "pic"])
def test_resumed_agents_equal_full_at_ratio_1(tiny_llama, mode):
    """Every reused token recomputed: a Mirror is exact, so restoring one and prefilling
    only the rest gives full mode's tokens, round after round, even when the Masters
    left the GPU between rounds (restored from the host once)."""
    eng, ref = engine(tiny_llama, recompute_ratio=1.0), engine(tiny_llama)
    prompts, spans = round_prompts(3, seed=21)
    outs, _ = run(eng, prompts, spans, mode, "r1-")
    assert outs == run(ref, prompts, spans, "full", "f1-", agents=False)[0]
    for rnd in (2, 3):
        prompts, spans = next_round(prompts, spans, outs, seed=rnd)
        eng.segments.clear()  # the Masters now live only on the host
        restored = eng.idle.restored
        work = eng.runner.work
        outs, usage = run(eng, prompts, spans, mode, f"r{rnd}-")
        assert outs == run(ref, prompts, spans, "full", f"f{rnd}-", agents=False)[0]
        assert eng.idle.restored - restored >= sum(len(p) for p in prompts) // 2
        assert all(u.cached_tokens > len(p) // 2 for u, p in zip(usage, prompts))
        assert (eng.runner.work - work) / len(eng.model.layers) < sum(len(p) for p in prompts)
    assert len(eng.idle.parked) == 3
    assert free_blocks_after_reset(eng)


def test_readers_park_as_mirrors_and_resume_exactly(tiny_llama):
    """Reader bases: the two readers, Mirrors of the bases they gave (backend/diff.py),
    park only what they hold privately, and their next requests restore it exactly
    (every reused token recomputed, so every answer equals full's). The next round quotes
    nothing new, so no request reads in full: every agent resumes."""
    eng, ref = engine(tiny_llama, recompute_ratio=1.0, bases="reader"), engine(tiny_llama)
    prompts, spans = round_prompts(4, seed=21)
    outs, _ = run(eng, prompts, spans, "collective", "r1-")
    assert outs == run(ref, prompts, spans, "full", "f1-", agents=False)[0]
    readers = [eng.idle.parked[f"\0a{i}"] for i in range(2)]  # no tenant
    assert all(p.mirror is not None and p.slots < len(p.tokens) for p in readers)
    prompts, spans = next_round(prompts, spans, outs, seed=2, n_new=0)
    eng.segments.clear()  # the Masters now live only on the host
    restored = eng.idle.restored
    outs, usage = run(eng, prompts, spans, "collective", "r2-")
    assert outs == run(ref, prompts, spans, "full", "f2-", agents=False)[0]
    assert eng.idle.restored - restored >= sum(len(p) for p in prompts) // 2
    assert all(u.cached_tokens > len(p) // 2 for u, p in zip(usage, prompts))
    assert free_blocks_after_reset(eng)


def test_parked_agents_read_in_full_for_reader_bases(tiny_llama):
    """A round of parked agents that quotes new outputs: its first two requests give up
    their parked prefixes and are prefilled whole (the readers, exact), the others
    restore theirs and read the readers' bases (every reused token recomputed, so every
    answer equals full's)."""
    eng, ref = engine(tiny_llama, recompute_ratio=1.0, bases="reader"), engine(tiny_llama)
    prompts, spans = round_prompts(4, seed=25)
    outs, _ = run(eng, prompts, spans, "collective", "r1-")
    prompts, spans = next_round(prompts, spans, outs, seed=3)
    restored = eng.idle.restored
    outs, usage = run(eng, prompts, spans, "collective", "r2-")
    assert outs == run(ref, prompts, spans, "full", "f2-", agents=False)[0]
    assert [u.cached_tokens for u in usage[:2]] == [0, 0]
    assert all(u.cached_tokens > len(p) // 2 for u, p in zip(usage[2:], prompts[2:]))
    assert eng.idle.restored - restored >= sum(len(p) for p in prompts[2:]) // 2
    new = {segment_key("", p[lo:hi]) for p, sp in zip(prompts, spans) for lo, hi in sp[-2:]}
    assert {eng.segments.get(k).source for k in new} == {"reader"}
    assert free_blocks_after_reset(eng)


@pytest.mark.parametrize("pooled", [True, False], ids=["in the pool", "on the host"])
@pytest.mark.parametrize("mode", ["collective", "pic"])
def test_an_agent_resumed_without_shared_segments(tiny_llama, mode, pooled):
    """A chat that only goes on (nothing shared, in either turn: a tool call, then its
    answer). While the first turn's blocks are still in the pool the next request finds
    its prefix there, as `prefix` does, and restores nothing; once the pool let them go,
    it restores the prefix from the host as a Mirror without a Master. Exact either way."""
    eng, ref = engine(tiny_llama), engine(tiny_llama)
    prompts = [round_prompts(2, seed=4)[0][i][:50 + 9 * i] for i in range(2)]
    spans = [[], []]
    outs, _ = run(eng, prompts, spans, mode, "r1-")
    prompts, _ = next_round(prompts, spans, outs, seed=5, n_new=0)
    if not pooled:
        eng.pool.forget()
    restored = eng.idle.restored
    outs, usage = run(eng, prompts, spans, mode, "r2-")
    assert outs == run(ref, prompts, spans, "full", "f2-", agents=False)[0]
    assert (eng.idle.restored > restored) is not pooled and all(u.cached_tokens >= 48 for u in usage)
    assert free_blocks_after_reset(eng)


def test_resumed_collective_at_ratio_15(tiny_llama):
    """The default ratio: resumed agents compute less than a cold round of the same
    prompts, keep their old patches, and leave no block or host byte behind."""
    eng = engine(tiny_llama)
    prompts, spans = round_prompts(4, seed=22)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    prompts, spans = next_round(prompts, spans, outs, seed=5)
    work = eng.runner.work
    run(eng, prompts, spans, "collective", "b-")
    resumed = eng.runner.work - work
    cold = engine(tiny_llama)
    run(cold, prompts, spans, "collective", "c-", agents=False)
    assert resumed < 0.5 * cold.runner.work
    assert free_blocks_after_reset(eng)


def test_full_mode_stays_the_no_reuse_baseline(tiny_llama):
    eng = engine(tiny_llama)
    prompts, spans = round_prompts(2, seed=23)
    outs, _ = run(eng, prompts, spans, "full", "a-")
    assert not eng.idle.parked
    prompts, spans = next_round(prompts, spans, outs, seed=6)
    _, usage = run(eng, prompts, spans, "full", "b-")
    assert all(u.cached_tokens == 0 for u in usage)


@pytest.mark.parametrize("between", ["full", "prefix"])
def test_a_parked_prefix_outlives_requests_that_do_not_park(tiny_llama, between):
    """full and prefix requests neither restore nor park: an agent's parked prefix stays
    the one its last reusing request left, and its next reusing request restores it
    (every reused token recomputed: it answers as full does)."""
    eng, ref = engine(tiny_llama, recompute_ratio=1.0), engine(tiny_llama)
    prompts, spans = round_prompts(2, seed=26)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    parked = {k: list(p.tokens) for k, p in eng.idle.parked.items()}
    restored = eng.idle.restored
    run(eng, *next_round(prompts, spans, outs, seed=7), between, "b-")
    assert {k: list(p.tokens) for k, p in eng.idle.parked.items()} == parked
    assert eng.idle.restored == restored
    later, later_spans = next_round(prompts, spans, outs, seed=8)  # goes on from round 1's prompts
    outs, _ = run(eng, later, later_spans, "collective", "c-")
    assert outs == run(ref, later, later_spans, "full", "f-", agents=False)[0]
    assert eng.idle.restored - restored >= sum(len(p) for p in prompts) // 2
    assert free_blocks_after_reset(eng)


def test_a_changed_prompt_restores_nothing(tiny_llama):
    eng = engine(tiny_llama)
    prompts, spans = round_prompts(2, seed=24)
    run(eng, prompts, spans, "collective", "a-")
    assert set(eng.idle.parked) == {"\0a0", "\0a1"} and eng.idle.bytes > 0
    other, other_spans = round_prompts(2, seed=25)  # unrelated prompts from the same agents
    restored = eng.idle.restored
    _, usage = run(eng, other, other_spans, "collective", "b-")
    assert eng.idle.restored == restored
    assert all(u.cached_tokens <= u.shared_tokens for u in usage)
    assert free_blocks_after_reset(eng)


@pytest.mark.parametrize("pages", [0, 1])
def test_offload_off_or_too_small_parks_nothing(tiny_llama, pages):
    """No host tier, or one host page: an agent and the Masters it reads never fit, so
    nothing is parked and nothing is left held (a Master put for it is freed)."""
    page = engine(tiny_llama).idle.tier.arena.page_bytes
    eng = engine(tiny_llama, offload_bytes=pages * page)
    prompts, spans = round_prompts(2, seed=26)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    assert not eng.idle.parked and eng.idle.bytes == 0 and not eng.idle.tier.masters
    assert outs == run(engine(tiny_llama), prompts, spans, "collective", "b-")[0]


def test_abort_of_a_resuming_request_drops_its_parked_kv(tiny_llama):
    eng = engine(tiny_llama)
    prompts, spans = round_prompts(2, seed=27)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    prompts, spans = next_round(prompts, spans, outs, seed=7)
    eng.add("x", prompts[0], GREEDY, mode="collective", shared=spans[0], agent="a0")
    assert eng.seqs["x"].resume is not None
    assert eng.abort("x")
    assert "\0a0" not in eng.idle.tier
    assert free_blocks_after_reset(eng)


def test_agents_evicted_for_budget_are_prefilled(tiny_llama):
    """A host budget for about one agent: parking the second evicts the first, whose next
    request then prefills in full (and still gives full's tokens at ratio 1)."""
    probe = engine(tiny_llama)
    prompts, spans = round_prompts(2, seed=28)
    run(probe, prompts, spans, "collective", "p-")
    held = [e.nbytes for e in probe.idle.tier.agents.values()]  # whole host pages
    one, masters = max(held), probe.idle.bytes - sum(held)
    eng, ref = engine(tiny_llama, recompute_ratio=1.0, offload_bytes=masters + one + 1), engine(tiny_llama)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    assert len(eng.idle.tier) == 1 and eng.idle.bytes <= eng.idle.tier.budget
    assert list(eng.idle.parked) == list(eng.idle.tier.agents)  # no record of the evicted one
    longest = max(len(p) + len(o) for p, o in zip(prompts, outs))
    prompts, spans = next_round(prompts, spans, outs, seed=8)
    restored = eng.idle.restored
    outs2, _ = run(eng, prompts, spans, "collective", "b-")
    assert outs2 == run(ref, prompts, spans, "full", "f-", agents=False)[0]
    assert 0 < eng.idle.restored - restored <= longest  # one agent's prefix, not two
    assert free_blocks_after_reset(eng)


def test_agents_parked_while_a_round_restores_evict_no_taken_agent(tiny_llama):
    """Requests restore in sub-batches (a small token budget) and finish at once (one
    token), so agents park while others still wait to restore. With a host budget for
    about one round, parking must not evict an agent whose request is waiting: that
    request would have nothing to restore."""
    probe = engine(tiny_llama)
    prompts, spans = round_prompts(4, seed=29)
    run(probe, prompts, spans, "collective", "p-")
    eng = engine(tiny_llama, max_batched_tokens=64, offload_bytes=probe.idle.bytes + 1)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    assert len(eng.idle.tier) == 4
    prompts, spans = next_round(prompts, spans, outs, seed=9)
    # A plain request decoding meanwhile: sub-batches then run one per step.
    eng.add("other", [5] * 8, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    eng.step()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"b{i}", p, one, mode="collective", shared=sp, agent=f"a{i}")
    assert all(s.resume is not None for rid, s in eng.seqs.items() if rid != "other")
    done, overlapped, restored = 0, False, eng.idle.restored
    while done < 4:
        done += sum(d.finish_reason is not None for rid, d in eng.step() if rid != "other")
        overlapped |= done > 0 and bool(eng.waiting.seqs)
    eng.abort("other")
    assert overlapped, "no agent parked while another waited to restore"
    assert eng.idle.restored - restored >= sum(len(p) for p in prompts) // 2  # all four resumed
    assert free_blocks_after_reset(eng)


def test_a_resume_that_falls_back_to_plain_prefill_frees_its_parked_kv(tiny_llama, monkeypatch):
    """When not even one waiting request fits the pool beside the segment cache, the
    first is prefilled plainly: its parked prefix leaves the host tier at once (a taken
    agent is never evicted, so keeping it would hold host memory until the request ends)."""
    eng, ref = engine(tiny_llama), engine(tiny_llama)
    prompts, spans = round_prompts(1, seed=30)
    outs, _ = run(eng, prompts, spans, "collective", "a-")
    prompts, spans = next_round(prompts, spans, outs, seed=10)
    eng.add("x", prompts[0], GREEDY, mode="collective", shared=spans[0], agent="a0")
    assert eng.seqs["x"].resume is not None and "\0a0" in eng.idle.tier
    monkeypatch.setattr(eng.collector, "prefill", lambda group, mode: ([], None))
    toks = [t for _, d in eng.step() for t in d.token_ids]  # the fallback, prefilled plainly
    assert "\0a0" not in eng.idle.tier and eng.seqs["x"].resume is None
    while eng.has_work():
        for _, d in eng.step():
            toks += d.token_ids
    assert toks == ref.generate([prompts[0]], GREEDY)[0][0]
    assert free_blocks_after_reset(eng)
