"""n-gram speculation behind the proxy: a streamed answer and a whole one as the engine
without drafts gives them (a step's several tokens reach the stream in order), and the
counters in /metrics."""

from __future__ import annotations

import httpx

from tokendance.backend.service import EngineBackend

from tests.backend.test_scheduling import prompts

from .conftest import Threaded

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def answers(t: Threaded) -> tuple[str, str, int]:
    """(whole text, streamed text, completion tokens) of a prompt whose greedy answer loops."""
    c = t.client()
    model = c.models.list().data[0].id
    kw = dict(model=model, prompt=prompts(6, seed=5)[0], max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    return whole.choices[0].text, streamed, whole.usage.completion_tokens


def test_answers_and_metrics_with_drafts(tiny_llama):
    plain = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"), barrier_timeout=10.0)
    try:
        want = answers(plain)
    finally:
        plain.close()
    spec = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full", speculative_config=SPEC),
                    barrier_timeout=10.0)
    try:
        got = answers(spec)
        text = httpx.get(spec.url + "/metrics").text
    finally:
        spec.close()
    assert got == want and want[0] == want[1] and want[2] == 40
    s = spec.backend.engine.speculator
    assert s.accepted > 0
    assert f"tokendance_engine_spec_decode_num_accepted_tokens_total {s.accepted:g}" in text
    assert f"tokendance_engine_spec_decode_num_draft_tokens_total {s.draft_tokens:g}" in text
