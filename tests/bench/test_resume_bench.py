"""`tokendance bench resume` on a tiny model: the round generator's second round, and
the benchmark's table (counts, not timings)."""

from __future__ import annotations

import json

import pytest

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
    resumed, without, prefix = (float(x) for x in cells[7].split("/"))
    assert max(resumed, prefix) < without  # both reuse the history
    restored = [int(x) for x in cells[8].split("/")]
    assert restored[0] > 0 == restored[1] == restored[2]


def test_bench_resume_writes_rows_and_rounds(tiny_llama, bench, tmp_path):
    rows, rounds = tmp_path / "rows.json", tmp_path / "rounds.json"
    bench(resume, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "2,3", "--history", "30",
          "--output", "12", "--answer", "5", "--repeats", "1", "--json", str(rows), "--dump-prompts", str(rounds))
    got = json.loads(rows.read_text())
    assert [(r["agents"], r["mode"], r["round"]) for r in got] == [
        (n, v, 2) for n in (2, 3) for v in ("resumed", "without", "prefix")]
    assert all(r["ms"] > 0 and len(r["all_ms"]) == 1 for r in got)
    resumed, without, prefix = got[:3]
    assert max(resumed["computed"], prefix["computed"]) < without["computed"]
    assert resumed["restored"] > 0 == without["restored"] == prefix["restored"]
    dumped = json.loads(rounds.read_text())
    assert sorted(dumped) == ["2", "3"]
    for n, r in dumped.items():
        assert len(r["before"]) == len(r["prompts"]) == int(n)
        for before, prompt in zip(r["before"], r["prompts"]):  # round 1 and its answer lead round 2
            assert prompt[: len(before)] == before and len(prompt) > len(before)
        assert sum(map(len, r["prompts"])) == next(x["prompt_tokens"] for x in got if x["agents"] == int(n))


@pytest.mark.parametrize("mode", ["kvcomm", "kvcmas"])
def test_bench_resume_anchored_restores_and_predicts(tiny_llama, bench, mode):
    out = bench(resume, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "3",
                "--history", "40", "--output", "20", "--answer", "6", "--repeats", "1",
                "--variants", f"{mode},without")
    head = [line for line in out.splitlines() if line.startswith("| N |")][0]
    assert (f"{mode} ms | without ms | {mode} vs without | computed {mode} / without "
            f"| restored {mode} / without") in head
    row = [line for line in out.splitlines() if line.startswith("| 3 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    anchored, without = (float(x) for x in cells[5].split("/"))
    # it computes past the check layer only what follows each restored prefix
    assert anchored < without / 2 and int(cells[6].split("/")[0]) > 0


def test_bench_resume_refuses_a_dump_without_prefix(tiny_llama, bench, tmp_path):
    with pytest.raises(ValueError, match="add prefix to --variants"):
        bench(resume, "--model", str(tiny_llama), "--agents", "2", "--variants", "resumed",
              "--dump-prompts", str(tmp_path / "x.json"))


def test_bench_resume_without_a_host_tier_restores_nothing(tiny_llama, bench):
    out = bench(resume, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "2", "--history", "30",
                "--output", "12", "--answer", "5", "--repeats", "1", "--variants", "resumed,kvcomm",
                "--offload-gib", "0")
    row = [line for line in out.splitlines() if line.startswith("| 2 |")][0]
    assert row.rstrip(" |").endswith("| 0 / 0") and "host tier 0 GiB" in out
