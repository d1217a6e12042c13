"""Where a shared segment's base KV comes from: a standalone prefill once per round (the
default), or with producer bases the KV its producer computed for its own output."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.pool import flat_slots
from tokendance.backend.segments import segment_key
from tests.backend.test_reuse import prefill_full


@pytest.mark.parametrize("max_tokens,reason", [(40, "stop"), (7, "length")])
def test_producer_output_becomes_base(smollm2, max_tokens, reason):
    # A real model: its outputs tokenize back to the tokens it generated. Ended by
    # length, the last token was never fed: the engine computes its K/V before publishing.
    engine = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048, bases="producer")
    prompt = engine.encode(engine.chat_prompt([{"role": "user", "content": "Name two colours."}]))
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
    assert engine.pool.num_free == engine.cache.num_blocks - len(entry.blocks)  # the request's own went back
    # The base holds exactly the producer's KV of those tokens (re-run to recompute it).
    ref = Engine(model=str(engine.folder), dtype="float32", kv_tokens=4096)
    rseq, = prefill_full(ref, [prompt + seq.out])
    b = engine.cache.block_size
    src = flat_slots(entry.blocks, torch.arange(len(ids)), b)
    dst = flat_slots(rseq.blocks, torch.arange(len(prompt), len(prompt) + len(ids)), b)
    for k0, k1 in zip(engine.cache.k, ref.cache.k):
        torch.testing.assert_close(k0.view(-1, *k0.shape[2:])[src], k1.view(-1, *k1.shape[2:])[dst],
                                   rtol=1e-4, atol=1e-5)


def test_standalone_bases_publish_nothing(smollm2):
    # The default: a shared segment's base is prefilled standalone, so a request's
    # output is not kept for the next round even when it asks to publish (the same
    # request publishes with producer bases: test_producer_output_becomes_base).
    eng = Engine(model=str(smollm2), dtype="float32", kv_tokens=2048)
    assert eng.cfg.bases == "standalone"
    prompt = eng.encode(eng.chat_prompt([{"role": "user", "content": "Name two colours."}]))
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
        assert ids == s.out and entry is not None and entry.source == "producer" and entry.ntokens == 6
        held += len(entry.blocks)
    assert forwards[-1] == 2  # the two ends in one forward
    base = engine.segments.get(segment_key("", shared))
    assert engine.pool.num_free == engine.cache.num_blocks - held - len(base.blocks)
