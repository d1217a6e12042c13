"""Splitting a group of prompts into forwards under a token budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def batches(items: list[T], size: Callable[[T], int], budget: int,
            remainder_first: bool = False) -> list[list[T]]:
    """Consecutive runs of `items` whose sizes sum to at most `budget` (0: no limit); an
    item larger than the budget makes a run of its own. Runs are filled from the front,
    or with `remainder_first` from the back (as few runs either way): the remainder
    then makes the first run."""
    if remainder_first:
        return [run[::-1] for run in batches(items[::-1], size, budget)[::-1]]
    out: list[list[T]] = []
    total = 0
    for it in items:
        n = size(it)
        if not out or (budget and total + n > budget):
            out.append([])
            total = 0
        out[-1].append(it)
        total += n
    return out
