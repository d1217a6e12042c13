"""`bench structured` times a structured output (a JSON schema, or the structural tag of
`auto` with a strict tool) against the same work unconstrained."""

from __future__ import annotations

import re

import pytest

from tokendance.bench import structured


@pytest.mark.parametrize("spec", ["json", "tools"])
def test_structured_bench_times_each_batch(tiny_llama, bench, spec):
    out = bench(structured, "--model", str(tiny_llama), "--batch", "1,2", "--repeats", "1",
                "--max-tokens", "6", "--spec", spec)
    assert f"; {spec} spec compiled in " in out
    rows = re.findall(r"^\| (\d) \| (\d+) \| [\d,.]+ \| [\d,.]+ \| ([\d.]+)x \|", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"] and all(0 < int(n) <= 6 * int(b) for b, n, _ in rows), out
