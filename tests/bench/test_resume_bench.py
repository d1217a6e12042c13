"""`tokendance bench resume` on a tiny model: the round generator's second round, and
the benchmark's table (counts, not timings)."""

from __future__ import annotations

from tokendance.bench import resume
from tokendance.bench.allgather import make_round, next_round


def test_next_round_keeps_old_blocks_and_adds_new_ones():
    r1 = make_round(3, 20, 10, 1000, seed=1)
    answers = [[7] * (i + 2) for i in range(3)]
    r2 = next_round(r1, answers, 10, 1000, seed=2)
    new = None
    for p1, sp1, a, p2, sp2 in zip(r1.prompts, r1.shared, answers, r2.prompts, r2.shared):
        assert p2[: len(p1) + len(a)] == p1 + a
        assert sp2[: len(sp1)] == sp1
        blocks = sorted(tuple(p2[lo:hi]) for lo, hi in sp2[len(sp1):])
        assert new is None or blocks == new  # every agent sees the same new outputs
        new = blocks
        assert all(lo >= len(p1) + len(a) for lo, _ in sp2[len(sp1):])
    assert len(new) == 3 and r2.outputs[:3] == r1.outputs


def test_bench_resume_table(tiny_llama, bench):
    out = bench(resume, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "2",
                "--history", "40", "--output", "20", "--answer", "6", "--repeats", "1")
    row = [line for line in out.splitlines() if line.startswith("| 2 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    resumed, without = (float(x) for x in cells[5].split("/"))
    assert resumed < without and int(cells[6]) > 0
