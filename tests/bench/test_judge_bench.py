"""`bench judge` gets the same scores three ways (it stops if they differ) and times each."""

from __future__ import annotations

import re

from tokendance.bench import judge


def test_judge_bench_times_three_ways_to_the_same_scores(tiny_llama, bench):
    out = bench(judge, "--model", str(tiny_llama), "--items", "3", "--words", "5", "--repeats", "1")
    assert re.search(r"^3 answers of ~\d+ prompt tokens", out, re.M), out
    rows = re.findall(r"^  (scoring|serial|concurrent) +[\d.]+ +[\d.]+ answers/s +([\d.]+)x serial", out, re.M)
    assert [r[0] for r in rows] == ["scoring", "serial", "concurrent"], out
    assert rows[1][1] == "1.00"
