"""vLLM's repetition_detection: a request ends once its output ends in a pattern repeated
min_count times (backend/repetition.py)."""

from __future__ import annotations

import pytest

from tokendance.backend.api import InvalidRequest, Repetition, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.repetition import repeats


@pytest.mark.parametrize("out, r, want", [
    ([1, 2, 3, 3, 3], Repetition(1, 1, 3), True),
    ([1, 2, 3, 3, 3], Repetition(1, 1, 4), False),
    ([9, 1, 2, 1, 2, 1, 2], Repetition(3, 2, 3), True),  # "1 2" three times
    ([9, 1, 2, 1, 2, 1, 2], Repetition(1, 0, 3), False),  # sizes 1 only (0 means 1)
    ([1, 2, 3, 1, 2, 3], Repetition(4, 1, 2), True),
    ([1, 2, 3, 1, 2, 4], Repetition(4, 1, 2), False),
    ([5, 5], Repetition(1, 1, 3), False),  # too short to hold three
    ([5, 5, 5], Repetition(0, 0, 0), False),  # off
])
def test_repeats_finds_a_pattern_at_the_end(out, r, want):
    assert repeats(out, len(out), r) is want


def test_only_the_tokens_so_far_count():
    assert repeats([7, 7, 7, 1], 3, Repetition(1, 1, 3))


@pytest.mark.parametrize("r, message", [
    (Repetition(2, 3, 2), "min_pattern_size <= max_pattern_size"),
    (Repetition(-1, 0, 2), "min_pattern_size <= max_pattern_size"),
    (Repetition(2, 1, 1), "min_count must be at least 2"),
])
def test_what_cannot_detect_is_refused(r, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(repetition=r).validate()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)


def test_a_loop_ends_the_request_past_min_tokens(engine):
    """Only token 5 may be sampled: the output is a loop of one token from the start."""
    def run(**kw):
        engine.add("r", list(range(100, 120)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                              allowed_token_ids=[5], **kw))
        deltas = []
        while engine.has_work():
            deltas += [d for _, d in engine.step()]
        return sum(len(d.token_ids) for d in deltas), deltas[-1]

    n, last = run(repetition=Repetition(2, 1, 4))
    assert (n, last.finish_reason, last.stop_reason) == (4, "repetition", "repetition_detected")
    assert last.usage.completion_tokens == 4
    n, last = run(repetition=Repetition(2, 1, 4), min_tokens=9)
    assert (n, last.finish_reason) == (9, "repetition")
    n, last = run()
    assert (n, last.finish_reason) == (30, "length")
