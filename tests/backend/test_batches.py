"""How the collector splits a round into forwards (`collector.batches`)."""

from __future__ import annotations

import random

import pytest

from tokendance.backend.batches import batches


def _check(items: list[int], runs: list[list[int]], budget: int) -> None:
    assert [x for run in runs for x in run] == items  # consecutive, in order
    assert all(run for run in runs)
    assert all(sum(run) <= budget or len(run) == 1 for run in runs)


@pytest.mark.parametrize("seed", range(20))
def test_both_ends_give_the_fewest_runs(seed):
    rng = random.Random(seed)
    budget = rng.choice([10, 25, 100])
    items = [rng.randint(1, budget + 5) for _ in range(rng.randint(1, 30))]
    front = batches(items, lambda x: x, budget)
    back = batches(items, lambda x: x, budget, remainder_first=True)
    for runs in (front, back):
        _check(items, runs, budget)
    assert len(back) == len(front)
    # Filled from the front: a run could not have taken the next run's first item;
    # from the back: nor the previous run's last.
    assert all(sum(a) + b[0] > budget for a, b in zip(front, front[1:]))
    assert all(sum(b) + a[-1] > budget for a, b in zip(back, back[1:]))


def test_the_remainder_comes_first():
    assert batches([4, 4, 4, 4, 4], lambda x: x, 8) == [[4, 4], [4, 4], [4]]
    assert batches([4, 4, 4, 4, 4], lambda x: x, 8, remainder_first=True) == [[4], [4, 4], [4, 4]]
    assert batches([3, 9, 3], lambda x: x, 0, remainder_first=True) == [[3, 9, 3]]  # no limit
    assert batches([], lambda x: x, 8, remainder_first=True) == []
