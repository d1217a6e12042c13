"""A segment's base KV can change under its key: reader bases are a reader's KV in its
own context, so a segment evicted and read again by a later round gets new K/V. A
parked agent was computed against the version it read; restoring it must give it that
version again, never another one the host or the segment cache holds under the key."""

from __future__ import annotations

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def _round(eng: Engine, prompts: dict[str, tuple[list[int], list[tuple[int, int]]]]) -> dict[str, list[int]]:
    """Run one collective round to the end, each request sent as its agent."""
    out: dict[str, list[int]] = {a: [] for a in prompts}
    for a, (p, sp) in prompts.items():
        eng.add(a, p, GREEDY, mode="collective", shared=sp, agent=a)
    while eng.has_work():
        for rid, d in eng.step():
            out[rid] += d.token_ids
    return out


def _with(g: torch.Generator, seg: list[int], hist: int) -> tuple[list[int], list[tuple[int, int]]]:
    """A private history, the shared segment, a private question."""
    head = _ids(g, hist)
    return head + seg + _ids(g, 5), [(len(head), len(head) + len(seg))]


def _resumed_logits(evict: bool, tiny_llama) -> tuple[torch.Tensor, Engine]:
    """Agent f's third-round logits. Round 1 (agents a, b, c) makes the segment's reader
    base v1 and parks it on the host; the segment cache loses it (as pool pressure
    would evict it); round 2 (agents d, e, f: d and e are its readers) makes v2 in their
    contexts, which f reads and is parked with. Before round 3, `evict` drops v2 from
    the segment cache too: f's Master then comes back from the host."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases="reader")
    g = torch.Generator().manual_seed(5)
    seg = _ids(g, 40)
    _round(eng, {a: _with(g, seg, 30 + 3 * i) for i, a in enumerate("abc")})
    eng.segments.clear()
    second = {a: _with(g, seg, 20 + 5 * i) for i, a in enumerate("def")}
    outs = _round(eng, second)
    if evict:
        eng.segments.clear()
    p, sp = second["f"]
    eng.add("f3", p + outs["f"] + _ids(g, 6), GREEDY, mode="collective", shared=sp, agent="f")
    seq = eng.seqs["f3"]
    assert seq.resume is not None
    ready, logits = eng.collector.prefill([seq], "collective")
    assert ready == [seq]
    return logits, eng


def test_a_resumed_agent_reads_the_base_it_was_computed_with(tiny_llama):
    kept, _ = _resumed_logits(False, tiny_llama)
    back, eng = _resumed_logits(True, tiny_llama)
    torch.testing.assert_close(back, kept, rtol=1e-5, atol=1e-5)


def test_an_agent_whose_base_was_replaced_is_prefilled_whole(tiny_llama):
    """Agent c (a Mirror; a and b were round 1's readers) read the round-1 base; after an
    eviction, round 2's readers (d and e, for f) put other K/V under the key. c's next request must not
    read those under private slots computed against the first: it is prefilled whole,
    as a request without a parked prefix would be."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases="reader")
    g = torch.Generator().manual_seed(6)
    seg = _ids(g, 40)
    first = {a: _with(g, seg, 30 + 3 * i) for i, a in enumerate("abc")}
    outs = _round(eng, first)
    eng.segments.clear()
    _round(eng, {a: _with(g, seg, 20 + 5 * i) for i, a in enumerate("def")})  # f reads d's and e's base
    p, sp = first["c"]
    prompt = p + outs["c"] + _ids(g, 6)
    got = []
    for agent in ("c", None):  # c resumes (or not); the same prompt without a parked prefix
        eng.add(f"x-{agent}", prompt, GREEDY, mode="collective", shared=sp, agent=agent)
        seq = eng.seqs[f"x-{agent}"]
        ready, logits = eng.collector.prefill([seq], "collective")
        assert ready == [seq]
        got.append((seq.cached, logits))
        eng.abort(seq.id)
    assert got[0][0] == got[1][0]  # nothing restored
    torch.testing.assert_close(got[0][1], got[1][1], rtol=1e-5, atol=1e-5)
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks and eng.idle.bytes == 0
