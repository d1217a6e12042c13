"""vLLM's thinking_token_budget: a think block's tokens are counted, and at the budget its
end is forced (backend/thinking.py)."""

from __future__ import annotations

import pytest

from tokendance.backend.api import InvalidRequest, SamplingParams, ThinkBudget
from tokendance.backend.engine import Engine
from tokendance.backend.thinking import Thought

START, END = [10], [11, 12]


def budget(n: int) -> ThinkBudget:
    return ThinkBudget(n, START, END)


def run(t: Thought, tokens: list[int]) -> list[int | None]:
    """What each step forces, as the tokens come one by one (a forced step takes its token)."""
    out, forced = [], []
    for tok in tokens:
        f = t.next()
        forced.append(f)
        out.append(tok if f is None else f)
        t.take(out)
    return forced


def test_a_block_the_model_opens_ends_at_the_budget():
    forced = run(Thought.of(budget(2), [1, 2, 3]), [5, 10, 6, 7, 8, 9, 4, 4])
    assert forced == [None, None, None, None, 11, 12, None, None]


def test_a_block_the_prompt_opened_counts_its_tokens_there_too():
    assert run(Thought.of(budget(3), [1, 10, 2]), [6, 7, 8, 9]) == [None, None, 11, 12]
    assert run(Thought.of(budget(0), [1, 10]), [6, 7, 8]) == [11, 12, None]
    assert Thought.of(budget(3), [1, 10, 2, 11, 12]).inside is False  # opened and closed: nothing to count


def test_a_block_closed_in_time_is_left_alone_and_the_next_counts_anew():
    forced = run(Thought.of(budget(3), []), [10, 6, 11, 12, 4, 10, 6, 7, 8, 8, 8])
    assert forced == [None] * 9 + [11, 12]


def test_an_end_the_model_began_at_the_budget_is_finished_not_restarted():
    assert run(Thought.of(budget(2), []), [10, 6, 11, 9, 9]) == [None, None, None, 12, None]


@pytest.mark.parametrize("b, message", [(ThinkBudget(-2, START, END), "at least 0"),
                                        (ThinkBudget(5, [], END), "open and close")])
def test_a_budget_that_cannot_be_is_refused(b, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(think_budget=b).validate()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)


@pytest.mark.parametrize("n", [0, 3])
def test_the_engine_forces_the_end_whatever_else_is_barred(engine, n):
    """The prompt opens the block; only token 5 may be sampled, yet the end comes at the
    budget, and only once."""
    prompt = list(range(100, 120)) + START
    sp = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, allowed_token_ids=[5], think_budget=budget(n))
    (ids, _, reason), = engine.generate([prompt], sp)
    assert ids == [5] * n + END + [5] * (7 - n) and reason == "length"
