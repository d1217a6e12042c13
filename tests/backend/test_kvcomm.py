"""kvcomm mode: exact rounds measure anchors; later rounds read base + predicted offset."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.anchors import Anchors
from tokendance.backend.api import ANCHORED
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tokendance.backend.scheduler import Scheduled

from .test_reuse import GREEDY, kv_of, round_prompts


@pytest.fixture(scope="module")
def deep(make_model):
    return make_model("llama", num_hidden_layers=4)  # layers past the check layer too


@pytest.fixture()
def engine(deep):
    # no lookahead (a GPU's default), whose step launched ahead feeds an answer's last
    # token too: what an agent parks is its prompt and its answer less that token
    return Engine(model=str(deep), dtype="float32", kv_tokens=8192, overlap=False)


def prefill(eng: Engine, mode: str, prompts, spans, tag: str = "", agents=None):
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        rid = f"{mode}{tag}-{i}"
        eng.add(rid, p, GREEDY, mode=mode, shared=sp, agent=agents[i] if agents else None)
        seqs.append(eng.seqs[rid])
    if mode in ANCHORED:
        ready, logits = eng.collector.prefill(seqs, mode)
    else:
        for s in seqs:
            assert eng.blocks.reserve(s, len(s.prompt))
        logits, _ = eng.runner.run([Scheduled(s, 0, len(s.prompt)) for s in seqs])
        ready = seqs
    assert ready == seqs
    return seqs, logits


def drop(eng: Engine, seqs) -> None:
    for s in seqs:
        eng.abort(s.id)
        eng.blocks.free(s)


def test_without_anchors_a_round_is_exact_and_measures_them(engine):
    prompts, spans = round_prompts(3, seed=4)
    full, full_logits = prefill(engine, "full", prompts, spans)
    exact = [kv_of(engine, s) for s in full]
    drop(engine, full)
    seqs, logits = prefill(engine, "kvcomm", prompts, spans, agents=["a", "b", "c"])
    for s, ex in zip(seqs, exact):
        assert s.cached == 0 and s.recomputed == 0
        torch.testing.assert_close(kv_of(engine, s), ex, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)
    # each segment: an anchor of its place from the end, and its text's offset where it sat
    assert len(engine.collector.anchors) == 2 * sum(len(sp) for sp in spans)


def test_an_anchor_of_the_same_context_gives_the_exact_kv(engine):
    """The same prompts again: each segment's one anchor has its own base, so its whole
    offset applies, and base + offset is the exact K/V the last round measured."""
    prompts, spans = round_prompts(3, seed=5)
    agents = ["a", "b", "c"]
    first, first_logits = prefill(engine, "kvcomm", prompts, spans, agents=agents)
    exact = [kv_of(engine, s) for s in first]
    drop(engine, first)
    again, logits = prefill(engine, "kvcomm", prompts, spans, tag="again", agents=agents)
    c = engine.collector.cfg.check_layer
    for s, ex, sp in zip(again, exact, spans):
        assert s.cached == sum(hi - lo for lo, hi in sp) > 0
        kv = kv_of(engine, s)
        torch.testing.assert_close(kv, ex, rtol=1e-4, atol=1e-5)
        # without the offset the shared tokens' later layers would read the bare base
        lo, hi = sp[0]
        assert (kv[c:, :, lo:hi] - ex[c:, :, lo:hi]).abs().max() < 1e-4
    torch.testing.assert_close(logits, first_logits, rtol=1e-4, atol=1e-4)


def test_a_new_round_reads_base_plus_offset_not_the_bare_base(engine):
    prompts, spans = round_prompts(3, seed=6)
    agents = ["a", "b", "c"]
    drop(engine, prefill(engine, "kvcomm", prompts, spans, agents=agents)[0])
    nxt, nspans = round_prompts(3, seed=7)  # other outputs, the same lengths
    seqs, _ = prefill(engine, "kvcomm", nxt, nspans, tag="next", agents=agents)
    c = engine.collector.cfg.check_layer
    for s, sp in zip(seqs, nspans):
        assert s.cached > 0
        kv = kv_of(engine, s)
        lo, hi = sp[0]
        e = engine.segments.get(segment_key("", s.prompt[lo:hi]))
        base = engine.collector.anchored["kvcomm"]._bases([(0, lo, hi, e)])
        offset = engine.collector.anchors.offsets([("kvcomm", "", s.sender, -len(sp))], base, [hi - lo])
        assert offset.abs().max() > 1e-3
        torch.testing.assert_close(kv[c:, :, lo:hi], base + offset)
    drop(engine, seqs)
    # agent "d" has no anchors: prefilled exactly
    alone, _ = prefill(engine, "kvcomm", nxt[:1], nspans[:1], tag="d", agents=["d"])
    assert alone[0].cached == 0


def test_a_prompt_grown_by_its_history_reads_its_old_segments_exactly(engine):
    """Round 3's prompt is round 2's, the agent's answer and the others' new outputs: the
    old segments read what they read in round 2 (exact: nothing before them changed),
    the new ones their base + the offset predicted at their places from the end."""
    prompts, spans = round_prompts(3, seed=9)
    agents = ["a", "b", "c"]
    drop(engine, prefill(engine, "kvcomm", prompts, spans, agents=agents)[0])
    new, nspans = round_prompts(3, seed=10, hist=5)
    grown = [p + [21, 22, 23] + q[5:] for p, q in zip(prompts, new)]
    gspans = [sp + [(lo - 5 + len(p) + 3, hi - 5 + len(p) + 3) for lo, hi in nsp]
              for p, sp, nsp in zip(prompts, spans, nspans)]
    full, _ = prefill(engine, "full", grown, gspans)
    exact = [kv_of(engine, s) for s in full]
    drop(engine, full)
    seqs, _ = prefill(engine, "kvcomm", grown, gspans, tag="grown", agents=agents)
    c = engine.collector.cfg.check_layer
    kvc = engine.collector.anchored["kvcomm"]
    for s, ex, sp, old in zip(seqs, exact, gspans, spans):
        assert s.cached == sum(hi - lo for lo, hi in sp)
        kv = kv_of(engine, s)
        for j, (lo, hi) in enumerate(sp):
            got = kv[c:, :, lo:hi]
            if j < len(old):
                torch.testing.assert_close(got, ex[c:, :, lo:hi], rtol=1e-4, atol=1e-5)
            else:
                base = kvc._bases([(j, lo, hi, engine.segments.get(segment_key("", s.prompt[lo:hi])))])
                offset = kvc.anchors.offsets([("kvcomm", "", s.sender, j - len(sp))], base, [hi - lo])
                assert offset.abs().max() > 1e-3
                torch.testing.assert_close(got, base + offset)
                assert (got - ex[c:, :, lo:hi]).abs().max() > 1e-3  # predicted, not exact


def test_greedy_generation_through_the_engine(engine):
    prompts, spans = round_prompts(3, seed=8)
    full = engine.generate(prompts, GREEDY, mode="full")
    who = ["a", "b", "c"]
    first = engine.generate(prompts, GREEDY, mode="kvcomm", shared=spans, agents=who)
    assert [t for t, _, _ in first] == [t for t, _, _ in full]
    engine.reset_caches(anchors=False)  # nothing parked: predicted, not restored
    again = engine.generate(prompts, GREEDY, mode="kvcomm", shared=spans, agents=who)  # the same contexts
    assert [t for t, _, _ in again] == [t for t, _, _ in full]
    assert engine.collector.anchored["kvcomm"].predicted == 3
    engine.reset_caches()
    assert len(engine.collector.anchors) == 0


def test_an_agent_resumes_its_parked_prefix(engine):
    """A finished kvcomm request is parked; its agent's next prompt (the last one, the
    answer, new outputs) restores that prefix, exact, and predicts only the new
    segments: the same K/V as computing the prefix again over the same offsets."""
    prompts, spans = round_prompts(3, seed=11)
    agents = ["a", "b", "c"]
    outs = [t for t, _, _ in engine.generate(prompts, GREEDY, mode="kvcomm", shared=spans, agents=agents)]
    assert sorted(engine.idle.parked) == [f"\0{a}" for a in agents]
    new, nspans = round_prompts(3, seed=12, hist=5)
    grown = [p + o + q[5:] for p, o, q in zip(prompts, outs, new)]
    gspans = [sp + [(lo - 5 + len(p) + len(o), hi - 5 + len(p) + len(o)) for lo, hi in nsp]
              for p, o, sp, nsp in zip(prompts, outs, spans, nspans)]
    full, _ = prefill(engine, "full", grown, gspans)
    exact = [kv_of(engine, s) for s in full]
    drop(engine, full)
    before = engine.idle.restored
    seqs, _ = prefill(engine, "kvcomm", grown, gspans, tag="resumed", agents=agents)
    starts = [len(p) + len(o) - 1 for p, o in zip(prompts, outs)]  # the last answer token was never fed
    assert engine.idle.restored - before == sum(starts)
    resumed = [kv_of(engine, s) for s in seqs]
    for s, kv, ex, a, sp, old in zip(seqs, resumed, exact, starts, gspans, spans):
        assert s.cached == a + sum(hi - lo for lo, hi in sp[len(old):])
        torch.testing.assert_close(kv[:, :, :a], ex[:, :, :a], rtol=1e-4, atol=1e-5)  # round 1 was exact
        lo, hi = sp[-1]
        assert (kv[:, :, lo:hi] - ex[:, :, lo:hi]).abs().max() > 1e-3  # predicted
    drop(engine, seqs)
    assert not engine.idle.parked  # taken by the requests above; aborted ones do not park
    again, _ = prefill(engine, "kvcomm", grown, gspans, tag="again", agents=agents)
    for s, kv in zip(again, resumed):
        assert s.cached == sum(hi - lo for lo, hi in s.shared)  # nothing restored: segments only
        torch.testing.assert_close(kv_of(engine, s), kv, rtol=1e-4, atol=1e-5)


def test_a_parked_mirror_is_not_restored_into_a_dense_cache(engine):
    prompts, spans = round_prompts(2, seed=13)
    done = engine.generate(prompts, GREEDY, mode="collective", shared=spans, agents=["a", "b"])
    outs = [t for t, _, _ in done]
    assert engine.idle.parked["\0a"].mirror is not None
    grown = [p + o + [5, 6] for p, o in zip(prompts, outs)]
    before = engine.idle.restored
    seqs, _ = prefill(engine, "kvcomm", grown, spans, agents=["a", "b"])
    assert engine.idle.restored == before and not engine.idle.parked and not engine.idle.tier.bytes
    assert [s.cached for s in seqs] == [0, 0]  # no anchors for a and b yet: prefilled whole, exactly


def kv(n: int, fill: float) -> torch.Tensor:
    return torch.full((2, 2, n, 1, 4), fill)


def ramp(values) -> torch.Tensor:
    """[2, 2, n, 1, 4]: token t's K and V all values[t]."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1, 1).expand(2, 2, -1, 1, 4).clone()


def test_each_token_takes_the_offset_of_the_nearest_measured_token():
    pool = Anchors(per=4, budget=1 << 20)
    a, b = ("", "a", 0), ("", "a", 1)
    assert pool.offsets([a], kv(3, 0.0), [3]) is None
    base = ramp(range(5))
    offset = -10 * base
    offset[:, 1] -= 1  # V's offsets differ from K's
    pool.add(a, offset, base)
    pool.add(b, ramp([7.0, 8.0]), ramp([100.0, 200.0]))  # a shorter pool: padding must not match
    # Segment a: six tokens (longer than its anchor), each near one measured token, K and V
    # apart; then segment b's two tokens, in the same search.
    new = torch.cat([ramp([4.1, 0.2, 2.0, 9.0, 1.4, 3.6]), ramp([0.0, 190.0])], 2)
    new[:, 1, 0] = 0.3  # V of the first token lies near measured token 0
    got = pool.offsets([a, b], new, [6, 2])
    assert got.shape == new.shape
    torch.testing.assert_close(got[:, 0, :, 0, 0], torch.tensor([-40.0, 0, -20, -40, -10, -40, 7, 8]).expand(2, 8))
    torch.testing.assert_close(got[:, 1, :, 0, 0], torch.tensor([-1.0, -1, -21, -41, -11, -41, 7, 8]).expand(2, 8))
    assert pool.offsets([a, ("", "b", 0)], new, [6, 2]) is None  # another agent's placeholder: none


def test_anchor_pool_bounds():
    pool = Anchors(per=2, budget=3 * 2 * kv(5, 0).numel() * 4)
    for i in range(3):
        pool.add(("", "a", 0), kv(5, float(i)), kv(5, float(i)))
    assert len(pool) == 2
    assert pool.offsets([("", "a", 0)], kv(1, 0.0), [1])[0, 0, 0, 0, 0] == 1.0  # the oldest went
    pool.add(("", "b", 0), kv(5, 0.0), kv(5, 0.0))
    pool.add(("", "b", 1), kv(5, 0.0), kv(5, 0.0))  # past the budget: a's placeholder goes first
    assert len(pool) == 3 and len(pool.places[("", "a", 0)]) == 1
    assert pool.nbytes <= pool.budget
    pool.add(("", "b", 1), kv(5, 2.0), per=1)  # a place of one: its anchor replaced, the place kept
    assert pool.get(("", "b", 1)).offset[0, 0, 0, 0, 0] == 2.0 and len(pool) == 3
    assert pool.nbytes == sum(a.nbytes for held in pool.places.values() for a in held)


def test_a_tensor_two_anchors_hold_counts_once():
    pool = Anchors(per=1, budget=1 << 20)
    off, base = kv(5, 1.0), kv(5, 2.0)
    one = off.numel() * 4
    pool.add(("", "a", -1), off, base)
    pool.add(("", "a", (0, b"k")), off, per=1)  # what the text read there: the same offset
    assert pool.nbytes == 2 * one and len(pool) == 2
    pool.add(("", "a", -1), kv(5, 3.0), kv(5, 3.0))  # a place of one: the first anchor goes
    assert pool.nbytes == 3 * one  # off is still held by the text's anchor; base went
    pool.add(("", "a", (0, b"k")), kv(5, 4.0), per=1)
    assert pool.nbytes == 3 * one and pool.refs and all(n == 1 for n in pool.refs.values())
    pool.clear()
    assert pool.nbytes == 0 and not pool.refs


def test_a_restored_exact_prefix_measures_the_places_it_covers(engine):
    """Round 1 exact: each agent parks a prefix an exact prefill gave. Its round-2 prompt
    restores it, old segments and all: they get anchors at their new places from the
    end (never measured otherwise), their exact K/V minus base. Round 2 predicts its new
    segments, so it is exact only up to the first of them (what it would park)."""
    prompts, spans = round_prompts(3, seed=14)
    agents = ["a", "b", "c"]
    outs = [t for t, _, _ in engine.generate(prompts, GREEDY, mode="kvcomm", shared=spans, agents=agents)]
    assert all(engine.idle.parked[f"\0{a}"].exact == len(p) + len(o) - 1 for a, p, o in zip(agents, prompts, outs))
    new, nspans = round_prompts(3, seed=15, hist=5)
    grown = [p + o + q[5:] for p, o, q in zip(prompts, outs, new)]
    gspans = [sp + [(lo - 5 + len(p) + len(o), hi - 5 + len(p) + len(o)) for lo, hi in nsp]
              for p, o, sp, nsp in zip(prompts, outs, spans, nspans)]
    places = lambda s, j: ("kvcomm", "", s.sender, j - len(s.shared))  # noqa: E731
    seqs, _ = prefill(engine, "kvcomm", grown, gspans, tag="r2", agents=agents)
    c = engine.collector.cfg.check_layer
    kvc = engine.collector.anchored["kvcomm"]
    for s, old in zip(seqs, spans):
        kv = kv_of(engine, s)
        for j, (lo, hi) in enumerate(old):  # restored, covered by the exact prefix
            a = engine.collector.anchors.get(places(s, j))
            base = kvc._bases([(j, lo, hi, engine.segments.get(segment_key("", s.prompt[lo:hi])))])
            torch.testing.assert_close(a.offset, kv[c:, :, lo:hi] - base)
            torch.testing.assert_close(a.base, base)
        assert s.exact == s.shared[len(old)][0]  # exact up to the first predicted segment


def test_a_request_computed_plainly_parks_an_exact_prefix(engine):
    """A first round with nothing shared is prefilled as any request is: exact, so what
    its agent parks is exact whole (its next round measures the places it covers)."""
    prompts, _ = round_prompts(2, seed=16)
    outs = [t for t, _, _ in engine.generate(prompts, GREEDY, mode="kvcomm", agents=["a", "b"])]
    for a, p, o in zip(["a", "b"], prompts, outs):
        assert engine.idle.parked[f"\0{a}"].exact == len(p) + len(o) - 1


def predicted_twice(engine) -> tuple[list[int], int]:
    """Two kvcomm rounds of agents a and b, the second predicting its new segments: agent
    a's next prompt (its prompt and answer) and where its parked K/V stop being exact."""
    prompts, spans = round_prompts(2, seed=17)
    agents = ["a", "b"]
    outs = [t for t, _, _ in engine.generate(prompts, GREEDY, mode="kvcomm", shared=spans, agents=agents)]
    new, nspans = round_prompts(2, seed=18, hist=5)
    grown = [p + o + q[5:] for p, o, q in zip(prompts, outs, new)]
    gspans = [sp + [(lo - 5 + len(p) + len(o), hi - 5 + len(p) + len(o)) for lo, hi in nsp]
              for p, o, sp, nsp in zip(prompts, outs, spans, nspans)]
    outs2 = [t for t, _, _ in engine.generate(grown, GREEDY, mode="kvcomm", shared=gspans, agents=agents)]
    first_predicted = gspans[0][len(spans[0])][0]
    assert engine.idle.parked["\0a"].exact == first_predicted
    return grown[0] + outs2[0], first_predicted


def test_a_request_is_no_more_exact_than_the_prefix_it_restores(engine):
    history, first_predicted = predicted_twice(engine)
    engine.add("c", history + [5, 6], GREEDY, mode="collective", agent="a")  # a plain restore
    seq = engine.seqs["c"]
    assert seq.resume is not None and seq.resume.length > first_predicted
    assert seq.exact == first_predicted


def test_a_prefix_restored_inexact_is_never_found_as_exact(engine):
    """A request that restored a predicted prefix and computed on plainly (no shared
    segment, no Mirror) gives the prefix cache its exact blocks only: a `prefix` request
    of its prompt finds those, not the predicted K/V after them (a random interleaving,
    tests/backend/test_chaos.py's play at seed 1531, served them to one as exact)."""
    history, exact = predicted_twice(engine)
    prompt = history + list(range(100, 140))
    engine.generate([prompt], GREEDY, mode="kvcomm", agents=["a"])  # restores, then computes plainly
    engine.add("p", prompt, GREEDY, mode="prefix")
    b = engine.cache.block_size
    assert 0 < engine.blocks.cached(engine.seqs["p"]) <= exact // b * b < len(prompt) - b
