"""Cached KV is found by content keys inside the tenant's namespace (backend/keys.py)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import sequence
from tokendance.backend.api import SamplingParams
from tokendance.backend.detok import Detok
from tokendance.backend.engine import Engine
from tokendance.backend.keys import chain, namespace, segment_key
from tests.backend.test_reuse import round_prompts

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def run(eng: Engine, rid: str, prompt: list[int], tenant: str, mode: str = "prefix",
        shared: list[tuple[int, int]] | None = None):
    eng.add(rid, prompt, ONE, mode=mode, shared=shared, tenant=tenant)
    usage = None
    while eng.has_work():
        for r, d in eng.step():
            if r == rid and d.usage is not None:
                usage = d.usage
    return usage


def test_keys_separate_tenants_kinds_contents_and_prefixes():
    ids = list(range(100, 116))
    a = chain(namespace("t1", "prefix"), ids)
    assert len(a) == 16 and a == chain(namespace("t1", "prefix"), tuple(ids))
    assert a != chain(namespace("t2", "prefix"), ids)
    assert a != chain(namespace("t1", "segment"), ids)
    assert a != chain(namespace("t1", "prefix"), ids[:-1] + [ids[-1] + 1])
    assert chain(a, ids) != chain(chain(namespace("t1", "prefix"), ids[::-1]), ids)
    # Token ids are hashed as 64-bit values: ids past 2**32 do not wrap onto small ones.
    assert chain(a, [2**32 + 5]) != chain(a, [5])
    assert segment_key("t1", ids) == chain(namespace("t1", "segment"), ids)


@pytest.fixture()
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)


def test_prefix_hits_stay_within_a_tenant(engine):
    prompt = torch.randint(3, 49152, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    assert run(engine, "a", prompt, "t1").cached_tokens == 0
    # Another API key's identical prompt computes everything: no KV of t1's, and no
    # latency that tells t2 such a prompt was sent.
    assert run(engine, "b", prompt, "t2").cached_tokens == 0
    assert run(engine, "c", prompt, "t1").cached_tokens == 96  # 6 full blocks of 16
    assert run(engine, "d", prompt, "t2").cached_tokens == 96


def test_segment_bases_stay_within_a_tenant(engine):
    prompts, spans = round_prompts(3, seed=3)
    for i, (p, s) in enumerate(zip(prompts, spans)):
        run(engine, f"a{i}", p, "t1", mode="collective", shared=s)
    keys = set(engine.segments.entries)
    assert keys == {segment_key("t1", prompts[0][lo:hi]) for lo, hi in spans[0]} | {
        segment_key("t1", prompts[1][lo:hi]) for lo, hi in spans[1]}
    for i, (p, s) in enumerate(zip(prompts, spans)):
        run(engine, f"b{i}", p, "t2", mode="collective", shared=s)
    assert len(engine.segments.entries) == 2 * len(keys)
    assert not keys & {segment_key("t2", prompts[0][lo:hi]) for lo, hi in spans[0]}


def test_a_requests_segment_keys_are_its_segments_hashed_once(monkeypatch):
    seq = sequence.Sequence("r", list(range(40)), SamplingParams(), Detok(None), shared=[(3, 10), (20, 38)],
                            tenant="t")
    want = [segment_key("t", list(range(3, 10))), segment_key("t", list(range(20, 38)))]
    assert seq.segment_keys() == want and want[0] != segment_key("", list(range(3, 10)))
    monkeypatch.setattr(sequence, "segment_key", lambda *a: pytest.fail("hashed again"))
    assert seq.segment_keys() == want
