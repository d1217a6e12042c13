"""`bench loops` runs a debate with repetition detection and without, and checks that
detection only cuts round-1 answers short (it stops otherwise)."""

from __future__ import annotations

import re

from tokendance.bench import loops


def test_loops_bench_counts_how_each_answer_ended(tiny_llama, bench):
    out = bench(loops, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2", "--max-tokens", "24",
                "--pattern", "4", "--repeats", "1")
    rows = dict(re.findall(r"^\| (with|without) \| ([\d,]+) \| \d+ \| \d+ \| \d+ \| [\d.]+ s \|$", out, re.M))
    assert set(rows) == {"with", "without"}, out
    assert all(0 < int(n.replace(",", "")) <= 4 * 24 for n in rows.values()), out  # 2 agents, 2 rounds
    assert re.search(r"^\| without \| [\d,]+ \| 0 \|", out, re.M), out  # no detection, no loop found
    assert "as fast" in out
