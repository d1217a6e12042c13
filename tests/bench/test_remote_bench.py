"""`tokendance bench remote`: the proxy over `tokendance engine` against the engine in-process."""

from __future__ import annotations

import argparse
import re

import pytest

from tokendance.bench import remote


def test_remote_bench_times_every_case_on_both_sides(bench, tiny_llama):
    out = bench(remote, "--model", str(tiny_llama), "--repeats", "1")
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == ["one token", "stream 32, first token", "stream 32, last token",
                                    f"round of {remote.AGENTS}"]
    for _, local, far, ratio in rows:
        (a, b, r), h = map(float, (local, far, ratio)), 0.05  # the times are printed to 0.1 ms
        assert a > h and b > 0
        assert (b - h) / (a + h) - 5e-4 <= r <= (b + h) / (a - h) + 5e-4


def test_no_repeats_is_refused():
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        remote.main(argparse.Namespace(model=None, dtype="float32", repeats=0))
