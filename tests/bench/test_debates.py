"""The debates `bench fidelity` runs: each round's prompts quote the earlier rounds'
outputs, and those are what the prepared requests share."""

from __future__ import annotations

import pytest

from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.service import EngineBackend
from tokendance.bench.debates import PROMPTS, Board, debate, questions
from tokendance.examples.debate import QUESTIONS as SIMULATED


@pytest.fixture(scope="module")
def be(tiny_llama) -> EngineBackend:
    return EngineBackend(Engine(EngineConfig(model=str(tiny_llama), dtype="float32", kv_tokens=4096)))


def quoted(be: EngineBackend, p, said: list[str]) -> list[str]:
    """Which of `said` each shared span holds (a token straddling a segment's edge is
    not in its span: the span is inside the text)."""
    out = []
    for lo, hi in p.state.shared:
        text = be.engine.tokenizer.decode(p.state.ids[lo:hi]).strip()
        (whole,) = [s for s in said if text in s]
        out.append(whole)
    return sorted(out)


@pytest.mark.parametrize("prompts", PROMPTS)
def test_each_round_shares_what_earlier_rounds_said(be, prompts):
    b = Board(debate(prompts, 3, 1))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    assert all(p.state.shared == [] for p in b.requests(be, "collective", greedy))
    r1 = [f"round one: agent {i}'s answer, long enough to find" for i in range(3)]
    b.observe(r1)
    for p in b.requests(be, "collective", greedy):  # its own answer and the two others'
        assert quoted(be, p, r1) == r1
    r2 = [f"round two: agent {i}'s answer, long enough to find" for i in range(3)]
    b.observe(r2)
    for p in b.requests(be, "collective", greedy):
        # The bench's debates quote the last round only; simulate's keep the whole chat.
        assert quoted(be, p, r1 + r2) == (r2 if prompts == "bench" else sorted(r1 + r2))


def test_questions_cycle_through_the_prompt_set():
    assert questions("simulate") == SIMULATED
    assert debate("simulate", 2, len(SIMULATED) + 1).question == SIMULATED[1]
    assert debate("bench", 2, 0).question == questions("bench")[0]
    assert debate("simulate", 4, 0).agents == ["Ada", "Bo", "Cy", "Dee"]
