"""Robustness under load: a small KV pool, many requests, reuse modes side by side."""

from __future__ import annotations

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.pool import BlockPool
from tokendance.backend.segments import SegmentCache
from tests.backend.test_reuse import round_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine(model, **kw) -> Engine:
    kw.setdefault("kv_tokens", 8192)
    return Engine(model=str(model), dtype="float32", **kw)


def run(eng: Engine, prompts, spans, mode: str, agents: bool = False) -> list[tuple[list[int], str]]:
    """Every request added at once (sent by agent a<i>), stepped to the end: (tokens,
    finish reason) each."""
    out = {f"r{i}": ([], "") for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"r{i}", p, GREEDY, mode=mode, shared=sp, agent=f"a{i}" if agents else None)
    while eng.has_work():
        for rid, d in eng.step():
            out[rid][0].extend(d.token_ids)
            if d.finish_reason:
                out[rid] = (out[rid][0], d.finish_reason)
    return [out[f"r{i}"] for i in range(len(prompts))]


def blocks_back(eng: Engine) -> bool:
    eng.reset_caches()
    return eng.pool.num_free == eng.cache.num_blocks


def test_evict_drops_bases_until_the_pool_has_room():
    """A dropped base's blocks are already back in the pool: they count once."""
    pool = BlockPool(10)
    cache = SegmentCache(pool, 16, max_blocks=10)
    for key in (1, 2):
        cache.put(key, 32, [pool.allocate(), pool.allocate()], "standalone")
    assert pool.num_free == 6
    cache.evict(9)
    assert pool.num_free == 10 and not cache.entries


@pytest.mark.parametrize("mode", ["pic", "collective"])
def test_a_round_in_a_pool_that_holds_one_request_at_a_time(tiny_llama, mode):
    """Each prompt needs 10 of the 12 blocks: requests are preempted and recomputed, the
    round's bases are evicted before any request starves, and a Mirror that cannot grow
    beside its Master is recomputed plain instead of cut short."""
    prompts, spans = round_prompts(6, seed=3, hist=20, out=15)
    want = run(engine(tiny_llama), prompts, spans, "full")
    eng = engine(tiny_llama, kv_tokens=16 * 12, recompute_ratio=1.0, max_batched_tokens=128)
    assert run(eng, prompts, spans, mode) == want
    assert blocks_back(eng)


@pytest.mark.parametrize("bad", [[(58, 73)], [(63, 68)], [(-3, 5)], [(5, 5)], [(10, 5)], [(0, 20), (10, 30)],
                                 [(0, 20), (0, 20)]])
def test_invalid_shared_spans_are_rejected_at_add(tiny_llama, bad):
    """Out of the prompt, empty, reversed or overlapping: a clear InvalidRequest for this
    request, not a failed step for every request in flight."""
    eng = engine(tiny_llama)
    prompts, spans = round_prompts(3, seed=5, hist=20, out=15)
    assert len(prompts[0]) == 63
    eng.add("ok", prompts[1], GREEDY, mode="collective", shared=spans[1])
    with pytest.raises(InvalidRequest, match="shared span"):
        eng.add("bad", prompts[0], GREEDY, mode="collective", shared=bad)
    assert "bad" not in eng.seqs
    while eng.has_work():
        eng.step()
    assert blocks_back(eng)


def test_unsorted_shared_spans_are_taken_in_order(tiny_llama):
    prompts, spans = round_prompts(2, seed=5, hist=20, out=15)
    want = run(engine(tiny_llama), prompts, spans, "collective")
    assert run(engine(tiny_llama), prompts, [sp[::-1] for sp in spans], "collective") == want


def test_an_agent_whose_second_master_finds_no_room_is_prefilled(tiny_llama, monkeypatch):
    """Its first Master was put back in the segment cache, its second found no room: it
    is prefilled instead, and the first (never filled, freed on the host with the
    agent) leaves the cache rather than failing the group's restore or being read."""
    eng = engine(tiny_llama, recompute_ratio=1.0)
    prompts, spans = round_prompts(3, seed=9, hist=20, out=15)
    p, sp = prompts[0], spans[0]  # two shared segments, this agent their only reader
    (out, _), = run(eng, [p], [sp], "collective", agents=True)
    eng.segments.clear()  # the Masters now live only on the host
    p2 = p + out + [11, 12, 13]
    holders = []
    reserve = eng.collector.reserve

    def second_master_fails(seq, n):
        if seq.id.startswith("master-"):
            holders.append(seq.id)
            if len(holders) == 2:
                return False
        return reserve(seq, n)

    monkeypatch.setattr(eng.collector, "reserve", second_master_fails)
    got = run(eng, [p2], [sp], "collective", agents=True)
    assert len(holders) == 2
    assert got == run(engine(tiny_llama), [p2], [sp], "full")
    assert eng.idle.restored == 0 and blocks_back(eng) and eng.idle.bytes == 0


def test_a_publishing_request_that_ends_in_its_prefill_step_starves_no_one(tiny_llama):
    """A producer's request that ends at its first token keeps its blocks until its
    output's K/V is written (its tail): that happens before the step schedules, so a
    request waiting for those blocks gets them instead of finishing with no tokens."""
    prompts, spans = round_prompts(2, seed=9, hist=60, out=60)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng = engine(tiny_llama, kv_tokens=16 * 16, bases="producer")
    eng.add("producer", prompts[0][:150], first, mode="collective", shared=[(0, 64)], publish=True)
    eng.add("waiting", prompts[1][:200], GREEDY)
    got: dict[str, list[int]] = {"producer": [], "waiting": []}
    while eng.has_work():
        for rid, d in eng.step():
            got[rid] += d.token_ids
    want = engine(tiny_llama).generate([prompts[1][:200]], GREEDY)[0][0]
    assert len(got["producer"]) == 1 and got["waiting"] == want
    assert blocks_back(eng)


def test_an_agents_request_ending_while_another_restores_its_kv(tiny_llama):
    """Agent X's parked KV is taken by its request r2, which waits behind a large round
    request; X's other request r3 ends first. Parking r3 must not replace what r2
    restores (it failed the step, or would restore r3's KV into r2)."""
    prompts, spans = round_prompts(3, seed=21, hist=30, out=20)
    eng = engine(tiny_llama, recompute_ratio=1.0, max_batched_tokens=64)
    (out, _), = run(eng, prompts[:1], spans[:1], "collective", agents=True)  # parked as agent a0
    p2 = prompts[0] + out + [11, 12, 13]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.add("big", prompts[1], GREEDY, mode="collective", shared=spans[1])
    eng.add("r2", p2, GREEDY, mode="collective", shared=spans[0], agent="a0")
    eng.add("r3", [5, 6, 7], one, mode="collective", agent="a0")
    got: dict[str, list[int]] = {"big": [], "r2": [], "r3": []}
    while eng.has_work():
        for rid, d in eng.step():
            got[rid] += d.token_ids
    assert eng.idle.restored >= len(prompts[0])
    assert got["r2"] == engine(tiny_llama).generate([p2], GREEDY)[0][0]
    assert blocks_back(eng) and eng.idle.bytes == 0


def test_a_failed_restore_leaves_no_unfilled_master_behind(tiny_llama, monkeypatch):
    """The Masters put back for a restore that then fails were never filled: they leave
    the segment cache with the failed prefill, so a later request computes them again
    rather than reading empty blocks."""
    prompts, spans = round_prompts(3, seed=9, hist=20, out=15)
    eng = engine(tiny_llama, recompute_ratio=1.0)
    (out, _), = run(eng, prompts[:1], spans[:1], "collective", agents=True)
    eng.segments.clear()  # the Masters now live only on the host
    p2 = prompts[0] + out + [11, 12, 13]

    def fails(*args, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.idle, "restore", fails)
    eng.add("r2", p2, GREEDY, mode="collective", shared=spans[0], agent="a0")
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.abort("r2")  # as AsyncEngine does after a failed step
    assert not eng.segments.entries
    monkeypatch.undo()
    assert run(eng, [p2], [spans[0]], "collective") == run(engine(tiny_llama), [p2], [spans[0]], "full")
    assert blocks_back(eng) and eng.idle.bytes == 0
