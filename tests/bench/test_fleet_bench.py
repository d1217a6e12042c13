"""`tokendance bench fleet`: simulations through a proxy over one engine and over two."""

from __future__ import annotations

import re

import pytest

from tokendance.bench import fleet


def test_fleet_bench_runs_both_proxies_and_splits_the_sessions(bench, tiny_llama):
    out = bench(fleet, "--model", str(tiny_llama), "--sessions", "2", "--agents", "2", "--rounds", "2",
                "--history", "20", "--output", "4", "--repeats", "1")
    assert "2 simulations x 2 agents x 2 rounds" in out
    rows = {m[1]: m for m in re.finditer(r"^\| (one engine|2 engines) \| (\d+) \| ([\d.]+) \| (\d+) \|$", out, re.M)}
    assert set(rows) == {"one engine", "2 engines"}
    assert all(float(m[3]) > 0 for m in rows.values())
    # Each pass's two sessions went one to each engine (and the warm-up's two before them).
    assert "sessions per engine (fleet_sessions) at the end: 2, 2" in out


def test_pinning_to_more_cores_than_there_are_is_refused():
    with pytest.raises(ValueError, match="a core per engine"):
        fleet._pinned("cpu", 10_000)
