"""kvcmas mode: kvcomm's places and rule over low-rank anchors, chained over its
producers' KV (KVCMAS)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tokendance.backend.lowrank import LowRank, dense
from tokendance.backend.pool import flat_slots
from tokendance.backend.prompt import render_chat

from .test_kvcomm import drop, prefill
from .test_reuse import kv_of, round_prompts


@pytest.fixture(scope="module")
def deep(make_model):
    return make_model("llama", num_hidden_layers=4)


def held(eng: Engine, mode: str) -> list:
    return [a for place, anchors in eng.collector.anchors.places.items() if place[0] == mode for a in anchors]


def test_its_anchors_are_low_rank_and_its_own(deep):
    """The same exact round in both modes: kvcmas's anchors are kvcomm's at rank 4, in
    places of their own, holding fewer bytes."""
    eng = Engine(model=str(deep), dtype="float32", kv_tokens=8192, anchor_rank=4)
    prompts, spans = round_prompts(3, seed=4)
    agents = ["a", "b", "c"]
    for mode in ("kvcomm", "kvcmas"):
        seqs, _ = prefill(eng, mode, prompts, spans, agents=agents)
        assert all(s.cached == 0 for s in seqs)  # no anchors yet: exact
        drop(eng, seqs)
    full, low = held(eng, "kvcomm"), held(eng, "kvcmas")
    assert len(full) == len(low) == 2 * sum(len(sp) for sp in spans)
    assert all(isinstance(a.held_offset, torch.Tensor) for a in full)
    assert all(isinstance(a.held_offset, LowRank) and a.held_offset.u.shape[-1] == 4 for a in low)
    assert sum(a.nbytes for a in low) < sum(a.nbytes for a in full) / 2
    by_shape = {}
    for a in full:
        by_shape.setdefault(a.offset.shape, []).append(a.offset)
    for a in low:  # each a rank-4 version of one of kvcomm's offsets, near it, not equal
        err = min(float((a.offset - o).norm() / o.norm()) for o in by_shape[a.offset.shape])
        assert 1e-4 < err < 1.0
    assert eng.collector.anchored["kvcmas"].measured == 3 and eng.collector.anchored["kvcomm"].measured == 3


def test_a_predicted_round_reads_base_plus_the_low_rank_offset(deep):
    eng = Engine(model=str(deep), dtype="float32", kv_tokens=8192, anchor_rank=4)
    prompts, spans = round_prompts(3, seed=6)
    agents = ["a", "b", "c"]
    drop(eng, prefill(eng, "kvcmas", prompts, spans, agents=agents)[0])
    nxt, nspans = round_prompts(3, seed=7)
    seqs, _ = prefill(eng, "kvcmas", nxt, nspans, tag="next", agents=agents)
    c = eng.collector.cfg.check_layer
    kvc = eng.collector.anchored["kvcmas"]
    for s, sp in zip(seqs, nspans):
        assert s.cached > 0 and s.recomputed == 0
        lo, hi = sp[0]
        base = kvc._bases([(0, lo, hi, eng.segments.get(segment_key("", s.prompt[lo:hi])))])
        place = ("kvcmas", "", s.sender, -len(sp))
        offset = eng.collector.anchors.offsets([place], base, [hi - lo])
        torch.testing.assert_close(kv_of(eng, s)[c:, :, lo:hi], base + offset)
        # each token's K (V) offset is a row of the low-rank anchors' K (V), read back whole
        pool = torch.cat([a.offset for a in eng.collector.anchors.places[place]], 2)
        rows = lambda t: t.permute(1, 2, 0, 3, 4).flatten(2)  # noqa: E731  [2, tokens, L*H*D]
        assert torch.cdist(rows(offset), rows(pool)).min(-1).values.max() < 1e-3
    assert kvc.predicted == 3


def test_its_requests_publish_their_outputs_as_the_next_rounds_bases(smollm2):
    """Chained: under standalone bases a kvcmas request still keeps its output's KV as
    its text's base (a kvcomm one does not), and the next round's kvcmas request that
    reads that text measures its offset from it."""
    eng = Engine(model=str(smollm2), dtype="float32", kv_tokens=4096)
    assert eng.cfg.bases == "standalone"
    ask = lambda q: eng.encode(render_chat(eng.tokenizer, [{"role": "user", "content": q}]))  # noqa: E731
    sampling = SamplingParams(max_tokens=7, temperature=0)
    eng.generate([ask("Name two colours.")], sampling, mode="kvcomm", publish=True, agents=["x"])
    assert not eng.segments.entries
    (out, text, _), = eng.generate([ask("Name two colours.")], sampling, mode="kvcmas", publish=True,
                                    agents=["a"])
    ids = eng.encode(text)
    entry = eng.segments.get(segment_key("", ids))
    assert ids == out and entry is not None and entry.source == "producer"
    head = eng.encode("<|im_start|>user\nAgent a said:")
    prompt = head + ids + eng.encode(" Do you agree?<|im_end|>\n<|im_start|>assistant\n")
    span = (len(head), len(head) + len(ids))
    seqs, _ = prefill(eng, "kvcmas", [prompt], [[span]], agents=["b"])
    assert seqs[0].cached == 0  # b's place had no anchor: exact, and measured
    a = eng.collector.anchors.get(("kvcmas", "", "b", -1))
    c = eng.collector.cfg.check_layer
    slots = flat_slots(entry.blocks, torch.arange(entry.ntokens), eng.cache.block_size)
    producer = eng.cache.kv.flatten(2, 3)[c:, :, slots]
    torch.testing.assert_close(a.base, producer)  # 7 tokens: too short to factor, held whole
    torch.testing.assert_close(dense(a.held_offset), kv_of(eng, seqs[0])[c:, :, span[0]:span[1]] - producer)
