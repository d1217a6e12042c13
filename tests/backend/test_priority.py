"""vLLM's --scheduling-policy priority (backend/scheduler.py): the lower priority value
first, then the earlier arrival; a waiting request takes the place of running ones of a
strictly lower priority; outputs stay what each request computes alone."""

from __future__ import annotations

import dataclasses

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tests.backend.test_scheduling import prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def at(priority: int, tokens: int = 12) -> SamplingParams:
    return dataclasses.replace(GREEDY, priority=priority, max_tokens=tokens)


def run(eng: Engine, out: dict[str, list[int]], until: str | None = None, steps: int = -1) -> list[str]:
    """Step until `until` finishes, or `steps` steps, or all is done; the requests that
    finished, in order (their tokens added to `out`)."""
    done = []
    while eng.has_work() and steps != 0 and until not in done:
        for rid, d in eng.step():
            out.setdefault(rid, []).extend(d.token_ids)
            if d.finish_reason:
                done.append(rid)
        steps -= 1
    return done


def test_the_most_urgent_are_served_first_then_by_arrival(tiny_llama):
    ps = prompts(4, seed=11)
    order = {}
    for policy in ("priority", "fcfs"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_seqs=1, scheduling_policy=policy)
        for rid, p, pr in zip("abcd", ps, (5, 0, -3, 0) if policy == "priority" else (0, 0, 0, 0)):
            eng.add(rid, p, at(pr))
        out: dict[str, list[int]] = {}
        order[policy] = run(eng, out)
        assert [out[r] for r in "abcd"] == solo(tiny_llama, ps)
        assert eng.pool.num_free == eng.cache.num_blocks
    assert order == {"priority": ["c", "b", "d", "a"], "fcfs": ["a", "b", "c", "d"]}


def test_a_waiting_request_preempts_running_ones_of_lower_priority_only(tiny_llama):
    p_low, p_high, p_same = prompts(3, seed=12)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, max_seqs=1, scheduling_policy="priority")
    out: dict[str, list[int]] = {}
    eng.add("low", p_low, at(4, 40))
    run(eng, out, steps=4)
    eng.add("same", p_same, at(4))  # as urgent: waits its turn
    run(eng, out, steps=1)
    assert eng.seqs["low"].preemptions == 0
    eng.add("high", p_high, at(1))
    done = run(eng, out)
    assert done == ["high", "low", "same"] and eng.seqs == {}
    assert [out["low"], out["high"], out["same"]] == [*solo(tiny_llama, [p_low], 40), *solo(tiny_llama, [p_high, p_same])]


def test_a_full_pool_makes_room_for_the_more_urgent(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 12, scheduling_policy="priority")
    long, other = prompts(2, seed=13)[0] * 2, prompts(2, seed=14)[1]
    eng.add("low", long[:140], at(9, 30))
    run(eng, {}, steps=3)
    low = eng.seqs["low"]
    eng.add("high", (other * 3)[:120], at(0))
    assert run(eng, {}, until="high") == ["high"] and low.preemptions >= 1
    assert run(eng, {}) == ["low"] and eng.scheduler.preemptions == low.preemptions
    assert eng.pool.num_free == eng.cache.num_blocks


def test_a_reuse_groups_most_urgent_request_makes_room_too(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 12, scheduling_policy="priority")
    eng.add("low", (prompts(1, seed=16)[0] * 3)[:140], at(9, 30))
    run(eng, {}, steps=3)
    low = eng.seqs["low"]
    shared = list(range(200, 240))
    eng.add("high", [5, 6, 7] + shared + list(range(300, 340)), at(0), mode="collective", shared=[(3, 43)])
    high = eng.seqs["high"]
    run(eng, {}, steps=1)  # low makes room; high is prefilled by reuse, its shared segment read from the base
    assert low.preemptions == 1 and high.out and high.cached > 0
    assert run(eng, {}, until="high") == ["high"]
    assert run(eng, {}) == ["low"] and eng.pool.num_free == eng.cache.num_blocks - eng.segments.held


def test_reuse_groups_wait_in_priority_order(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096, scheduling_policy="priority")
    shared = list(range(100, 140))
    for rid, pr in (("a", 2), ("b", -1), ("c", 2), ("d", 0)):
        eng.add(rid, [5, 6, 7] + shared + [8], at(pr), mode="collective", shared=[(3, 43)])
    assert [s.id for s in eng.waiting.seqs] == ["b", "d", "a", "c"]
    assert sorted(run(eng, {})) == ["a", "b", "c", "d"] and eng.pool.num_free == eng.cache.num_blocks - eng.segments.held


def test_first_come_first_served_refuses_a_priority(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024)
    with pytest.raises(InvalidRequest, match="priority 3: this engine serves first come, first served") as e:
        eng.add("x", [5, 6, 7], at(3))
    assert (e.value.param, e.value.code) == ("priority", "unsupported") and not eng.has_work()
    eng.add("y", [5, 6, 7], at(0))  # 0 is every request's priority
    with pytest.raises(InvalidRequest, match="unknown scheduling policy 'lifo'; choose one of fcfs, priority"):
        Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, scheduling_policy="lifo")
    with pytest.raises(InvalidRequest, match="priority must be a 64-bit signed integer"):
        at(2**63).validate()


def solo(folder, ps: list[list[int]], tokens: int = 12) -> list[list[int]]:
    """Each prompt's greedy tokens, computed alone."""
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=4096)
    return [eng.generate([p], at(0, tokens))[0][0] for p in ps]
