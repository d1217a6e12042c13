"""Where a shared segment's base KV comes from: a standalone prefill once per round (the
default); with producer bases the KV its producer computed for its own output; with
reader bases the KV of it in one of the round's requests, prefilled in full."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.pool import flat_slots
from tokendance.backend.prompt import render_chat
from tokendance.backend.scheduler import Scheduled
from tests.backend.test_reuse import GREEDY, prefill, prefill_full, round_prompts


def assert_producer_kv(engine: Engine, entry, prompt: list[int], out: list[int]) -> None:
    """The base holds exactly the producer's KV of the first entry.ntokens tokens of its
    output (a fresh engine prefills prompt and output to recompute it)."""
    ref = Engine(model=str(engine.folder), dtype="float32", kv_tokens=4096)
    rseq, = prefill_full(ref, [prompt + out])
    b, n = engine.cache.block_size, entry.ntokens
    src = flat_slots(entry.blocks, torch.arange(n), b)
    dst = flat_slots(rseq.blocks, torch.arange(len(prompt), len(prompt) + n), b)
    # Decode steps and one prefill take other matmul kernels: float32 rounding alone moved
    # single keys by up to 1.4e-5 (6e-4 of their value) by layer 3 on the AMD EPYC host, so
    # each layer is held to its relative error as a whole (at most 1.3e-6 there; a wrong
    # token or position is O(1)).
    for k0, k1 in zip(engine.cache.k, ref.cache.k):
        got, want = k0.view(-1, *k0.shape[2:])[src], k1.view(-1, *k1.shape[2:])[dst]
        assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("max_tokens,reason", [(40, "stop"), (7, "length")])
def test_producer_output_becomes_base(smollm2, max_tokens, reason):
    # A real model: its outputs tokenize back to the tokens it generated. Ended by
    # length, the last token was never fed: the engine computes its K/V before publishing.
    engine = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048, bases="producer")
    prompt = engine.encode(render_chat(engine.tokenizer, [{"role": "user", "content": "Name two colours."}]))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine.add("p", prompt, sampling, publish=True)
    seq = engine.seqs["p"]
    while engine.has_work():
        engine.step()
    assert seq.finish_reason == reason
    ids = engine.encode(seq.detok.text)
    assert ids == seq.out[: len(ids)] and (reason == "stop" or len(ids) == max_tokens)
    entry = engine.segments.get(segment_key("", ids))
    assert entry is not None and entry.source == "producer" and entry.ntokens == len(ids)
    rest = engine.segments.get(segment_key("", ids[1:]))  # for readers whose text joins its first token
    assert rest is not None and rest.ntokens == len(ids) - 1
    held = len(entry.blocks) + len(rest.blocks)
    assert engine.segments.held == held and engine.pool.num_free == engine.cache.num_blocks - held  # the request's own went back
    assert_producer_kv(engine, entry, prompt, seq.out)
    assert_producer_kv(engine, rest, prompt + seq.out[:1], seq.out[1:])


@pytest.mark.parametrize("stop, tokens", [("no", 2), ("mutually", 7)])
def test_an_answer_with_whitespace_around_it_is_published_as_the_proxy_finds_it(smollm2, stop, tokens):
    # The proxy finds an earlier answer in the next prompts stripped of the whitespace
    # around it (proxy/segment.py), and a stop string often leaves some ("There are "
    # before "no"), which tokenizes apart from the generated tokens. The stripped
    # answer's tokens are a run of the generated ones: their K/V is the base readers
    # look up.
    engine = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048, bases="producer")
    prompt = engine.encode(render_chat(engine.tokenizer, [{"role": "user", "content": "Name two colours."}]))
    engine.add("p", prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]), publish=True)
    seq = engine.seqs["p"]
    while engine.has_work():
        engine.step()
    assert seq.finish_reason == "stop" and seq.detok.text != seq.detok.text.strip()
    ids = engine.encode(seq.detok.text.strip())
    entry = engine.segments.get(segment_key("", ids))
    assert entry is not None and entry.source == "producer" and entry.ntokens == len(ids) == tokens
    assert_producer_kv(engine, entry, prompt, seq.out)


def test_standalone_bases_publish_nothing(smollm2):
    # The default: a shared segment's base is prefilled standalone, so a request's
    # output is not kept for the next round even when it asks to publish (the same
    # request publishes with producer bases: test_producer_output_becomes_base).
    eng = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048)
    assert eng.cfg.bases == "standalone"
    prompt = eng.encode(render_chat(eng.tokenizer, [{"role": "user", "content": "Name two colours."}]))
    eng.generate([prompt], SamplingParams(max_tokens=7, temperature=0), publish=True)
    assert not eng.segments.entries and eng.pool.num_free == eng.cache.num_blocks


def test_mirrors_ending_by_length_publish_their_whole_output(smollm2):
    # Two agents of a collective round end by length: one forward computes both last
    # tokens' K/V (through their Mirrors), then each output is the next round's base.
    engine = Engine(model=str(smollm2), dtype="float32", kv_tokens=4096, bases="producer")
    shared = engine.encode("Red, yellow and blue are the primary colours of paint: mixed in pairs they "
                           "give orange, green and purple, and all three together a muddy brown.")
    sampling = SamplingParams(max_tokens=6, temperature=0)
    seqs = []
    for i, q in enumerate(["Name two colours.", "Which colours are primary?"]):
        head = engine.encode("<|im_start|>user\n")
        prompt = head + shared + engine.encode(f" {q}<|im_end|>\n<|im_start|>assistant\n")
        engine.add(f"a{i}", prompt, sampling, mode="collective", shared=[(len(head), len(head) + len(shared))],
                   publish=True)
        seqs.append(engine.seqs[f"a{i}"])
    forwards = []
    run = engine.runner.run
    engine.runner.run = lambda work, *a: forwards.append(len(work)) or run(work, *a)
    usage = {}
    while engine.has_work():
        usage.update((rid, d.usage) for rid, d in engine.step() if d.usage)
    held = 0
    for s in seqs:
        assert s.finish_reason == "length" and usage[s.id].cached_tokens > 0  # it read the Master
        ids = engine.encode(s.detok.text)
        entry = engine.segments.get(segment_key("", ids))
        rest = engine.segments.get(segment_key("", ids[1:]))
        assert ids == s.out and entry is not None and entry.source == "producer" and entry.ntokens == 6
        assert rest is not None and rest.source == "producer" and rest.ntokens == 5
        held += len(entry.blocks) + len(rest.blocks)
    assert forwards[-1] == 2  # the two ends in one forward
    base = engine.segments.get(segment_key("", shared))
    assert engine.pool.num_free == engine.cache.num_blocks - held - len(base.blocks)


def _reader_round(tiny_llama, bases: str, extra: bool = False, **cfg):
    """A collective round of four agents (each sees the other three outputs); with
    `extra`, the last agent also holds a segment no other prompt has."""
    prompts, spans = round_prompts(4, seed=21)
    if extra:
        lo = len(prompts[3])
        prompts[3] = prompts[3] + list(range(100, 140)) + [12]
        spans[3] = spans[3] + [(lo, lo + 40)]
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases=bases, **cfg)
    seqs, logits = prefill(eng, "collective", prompts, spans)
    return eng, prompts, spans, seqs, logits


@pytest.mark.parametrize("budget", [0, 100])
def test_reader_bases_are_a_readers_exact_kv(tiny_llama, budget):
    # The first two requests are prefilled in full (exact; with a budget of 100 tokens
    # per forward, in chunks); every segment they hold takes its base from its latest
    # occurrence in them; the others are Mirrors of those bases.
    eng, prompts, spans, seqs, logits = _reader_round(tiny_llama, "reader", max_batched_tokens=budget)
    ref = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    full = prefill_full(ref, prompts)
    lead_logits, _ = ref.runner.run([Scheduled(s, len(s.prompt) - 1, 1) for s in full[:2]])
    torch.testing.assert_close(logits[:2], lead_logits, rtol=1e-4, atol=1e-5)
    for s in seqs[:2]:
        assert s.cached == s.recomputed == 0 and s.computed == len(s.prompt)
    for s in seqs[2:]:
        assert s.mirror is not None and s.cached > 0
        assert s.cached + s.recomputed == sum(hi - lo for lo, hi in s.shared)
    b = eng.cache.block_size
    assert len(eng.segments.entries) == 4 and {e.source for e in eng.segments.entries.values()} == {"reader"}
    for key, e in eng.segments.entries.items():
        found = [(lo, i) for i in range(2) for lo, hi in spans[i]
                 if segment_key("", prompts[i][lo:hi]) == key]
        lo, i = max(found)
        src = flat_slots(e.blocks, torch.arange(e.ntokens), b)
        dst = flat_slots(full[i].blocks, torch.arange(lo, lo + e.ntokens), b)
        for k0, k1 in zip(eng.cache.k, ref.cache.k):
            torch.testing.assert_close(k0.view(-1, *k0.shape[2:])[src], k1.view(-1, *k1.shape[2:])[dst],
                                       rtol=1e-4, atol=1e-5)
    # The readers are Mirrors of what they gave (backend/diff.py): those segments' tokens
    # read the Master in every layer, the rest as before; every layer still reads each
    # token's exact K/V.
    for i, s in enumerate(seqs[:2]):
        n = len(s.prompt)
        assert s.mirror is not None and s.mirror.held(n) < n
        gave = [(lo, hi) for lo, hi in spans[i]
                if max((lo2, j) for j in range(2) for lo2, hi2 in spans[j]
                       if prompts[j][lo2:hi2] == prompts[i][lo:hi]) == (lo, i)]
        assert gave
        rows = torch.arange(n)
        for view in (EARLY, LATE):
            own = s.mirror.own_index(view, rows)
            for lo, hi in gave:
                assert (own[lo:hi] < 0).all()
        for layer, (k0, k1, v0, v1) in enumerate(zip(eng.cache.k, ref.cache.k, eng.cache.v, ref.cache.v)):
            got = s.read_slots(rows, EARLY if layer < eng.runner.late_from else LATE, b)
            want = flat_slots(full[i].blocks, rows, b)
            for c0, c1 in ((k0, k1), (v0, v1)):
                torch.testing.assert_close(c0.view(-1, *c0.shape[2:])[got], c1.view(-1, *c1.shape[2:])[want],
                                           rtol=1e-4, atol=1e-5)


def test_segments_no_reader_holds_are_prefilled_standalone(tiny_llama):
    eng, *_ = _reader_round(tiny_llama, "reader", extra=True)
    sources = sorted(e.source for e in eng.segments.entries.values())
    assert sources == ["reader"] * 4 + ["standalone"]


def ring_prompts(n: int, k: int, seed: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """A partial broadcast: agent i's private history, then outputs i+1 .. i+k (cyclic)."""
    g = torch.Generator().manual_seed(seed)
    outputs = [torch.randint(3, 49152, (30,), generator=g).tolist() for _ in range(n)]
    prompts, spans = [], []
    for i in range(n):
        ids = torch.randint(3, 49152, (40 + 3 * i,), generator=g).tolist()
        sp = []
        for d in range(1, k + 1):
            sp.append((len(ids), len(ids) + 30))
            ids += outputs[(i + d) % n] + [11]
        prompts.append(ids + [12, 13])
        spans.append(sp)
    return prompts, spans


@pytest.mark.parametrize("n,k,readers", [(4, 1, [1, 1, 1, 1]), (5, 2, [1, 1, 0, 1, 0])])
def test_a_request_reads_in_full_where_no_reader_holds_its_segments(tiny_llama, n, k, readers):
    # Past the first two readers, a request is prefilled in full when the segments no
    # reader holds yet outweigh (1 - r) of its shared tokens: in a ring of chains (each
    # output quoted once) every request, so the round is exact and computes what `full`
    # does; where each quotes two, those that hold two new segments. No base is
    # prefilled standalone, and only the segments a Mirror reads are kept as bases.
    prompts, spans = ring_prompts(n, k, seed=24)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases="reader")
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"r{i}", p, GREEDY, mode="collective", shared=sp)
    seqs = [eng.seqs[f"r{i}"] for i in range(n)]
    ready, got = eng.collector.prefill(seqs, "collective")
    assert sorted(s.id for s in ready) == sorted(s.id for s in seqs)  # readers first
    logits = got[[ready.index(s) for s in seqs]]
    assert [int(s.reader) for s in seqs] == readers
    read = {segment_key("", prompts[i][lo:hi]) for i in range(n) if not readers[i] for lo, hi in spans[i]}
    assert set(eng.segments.entries) == read and len(read) == (0 if k == 1 else 4)
    assert {e.source for e in eng.segments.entries.values()} <= {"reader"}
    ref = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    full = prefill_full(ref, prompts)
    want, _ = ref.runner.run([Scheduled(s, len(s.prompt) - 1, 1) for s in full])
    for i, s in enumerate(seqs):
        if readers[i]:
            assert s.cached == s.recomputed == 0
            torch.testing.assert_close(logits[i], want[i], rtol=1e-4, atol=1e-5)
        else:
            assert s.cached > 0


def test_reader_bases_collective_equals_pic(tiny_llama):
    prompts, spans = round_prompts(4, seed=22)
    got = {}
    for mode in ("pic", "collective"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases="reader")
        seqs, logits = prefill(eng, mode, prompts, spans)
        got[mode] = [s.recomputed for s in seqs], logits
    assert got["pic"][0] == got["collective"][0] and all(got["pic"][0][2:])
    torch.testing.assert_close(got["pic"][1], got["collective"][1], rtol=1e-4, atol=1e-5)


def test_readers_answer_exactly_beside_their_mirrors(tiny_llama):
    # Generated end to end: the readers decode in one batch with the Mirrors and give
    # what full prefill gives; the round frees everything but the bases.
    prompts, spans = round_prompts(4, seed=23)
    full = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192).generate(prompts, GREEDY)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, bases="reader")
    out = eng.generate(prompts, GREEDY, mode="collective", shared=spans)
    assert out[:2] == full[:2] and len(out) == 4
    held = sum(len(e.blocks) for e in eng.segments.entries.values())
    assert eng.pool.num_free == eng.cache.num_blocks - held


def test_reader_bases_under_preemption(tiny_llama):
    # A pool too small for the round: Mirrors are preempted and prefilled again (every
    # reused token recomputed, so every answer is exact), and nothing leaks.
    prompts, spans = round_prompts(4, seed=23)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192).generate(prompts, sampling)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 40, bases="reader",
                 recompute_ratio=1.0)
    preempted = []
    real = eng.scheduler.preempt
    eng.scheduler.preempt = lambda seq: preempted.append(seq.id) or real(seq)
    out = eng.generate(prompts, sampling, mode="collective", shared=spans)
    assert preempted and [t for t, _, _ in out] == [t for t, _, _ in full]
    held = sum(len(e.blocks) for e in eng.segments.entries.values())
    assert eng.pool.num_free == eng.cache.num_blocks - held
