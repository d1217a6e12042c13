"""Option types of the benchmarks' command lines (argparse `type=`): a bad value is a
one-line usage error when the command line is parsed, before any model loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tokendance.backend.flags import at_least


positive = at_least(1)
natural = at_least(0)


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}") from None


def counts(text: str) -> list[int]:
    """'10,20' -> [10, 20]: integers of at least 1."""
    out = _numbers(text, int, "integers")
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"every count must be at least 1, got {text!r}")
    return out


def shares(text: str) -> list[float]:
    """'0.15,0.05' -> [0.15, 0.05]: numbers in [0, 1]."""
    out = _numbers(text, float, "numbers")
    if not all(0 <= x <= 1 for x in out):
        raise argparse.ArgumentTypeError(f"every share must lie in [0, 1], got {text!r}")
    return out


def share(text: str) -> float:
    """'0.15' -> 0.15: one number in [0, 1]."""
    x = _number(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text!r}")
    return x


def nonnegative(text: str) -> float:
    """'0.3' -> 0.3: one number of at least 0."""
    x = _number(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text!r}")
    return x


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def names(allowed: tuple[str, ...], least: int = 0) -> Callable[[str], list[str]]:
    """A comma list of at least `least` names out of `allowed` ('' is none)."""

    def parse(text: str) -> list[str]:
        out = [x for x in text.split(",") if x]
        bad = [x for x in out if x not in allowed]
        if bad or len(out) < least:
            what = f"unknown {', '.join(map(repr, bad))}" if bad else f"at least {least} needed"
            raise argparse.ArgumentTypeError(f"{what}: expected some of {','.join(allowed)}")
        return out

    return parse


def batches(text: str) -> list[tuple[int, int]]:
    """'1x1024,8x256' -> [(1, 1024), (8, 256)]: BATCHxLEN pairs of integers of at least 1
    ('' is none)."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        try:
            pair = tuple(int(p) for p in parts)
        except ValueError:
            pair = ()
        if len(pair) != 2 or min(pair) < 1:
            raise argparse.ArgumentTypeError(f"expected BATCHxLEN pairs of positive integers, "
                                             f"got {item!r}")
        out.append(pair)
    return out
