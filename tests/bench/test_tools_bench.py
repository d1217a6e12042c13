"""`bench tools` runs its rounds of tool-calling agents in every mode and reports what
the turns' second requests reused."""

from __future__ import annotations

import re

import pytest

from tokendance.bench import tools as tools_bench


@pytest.mark.parametrize("offload", ["1", "0"])
def test_tools_bench_reports_each_mode_and_round(tiny_llama, bench, offload):
    out = bench(tools_bench, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2", "--repeats", "1",
                "--max-tokens", "4", "--offload-gib", offload)
    assert f"host tier {offload} GiB" in out
    rows = {(m[1], int(m[2])): m for m in re.finditer(
        r"^\| 2 \| (\w+) \| (\d) \| [\d,]+ \| ([\d.]+)x \| 1 \| [\d,]+ \| ([\d,]+) / ([\d,]+) \(\d+%\) \| "
        r"([\d,]+) / ([\d,]+) \(\d+%\) \|$", out, re.M)}
    assert set(rows) == {(m, r) for m in tools_bench.MODES for r in (1, 2)}, out
    assert all(rows["full", r][3] == "1.00" and rows["full", r][6] == "0" for r in (1, 2))
    cached = {k: int(m[6].replace(",", "")) for k, m in rows.items()}  # of the answers' prompts
    assert all(cached["prefix", r] > 0 for r in (1, 2)), out  # each starts with its call's prompt,
    assert cached["collective", 1] > 0, out  # in the pool in round 1 (nothing shared yet)
    if offload == "1":  # and parked (a Mirror, once its call read shared answers) in round 2
        assert cached["collective", 2] > 0, out
    assert re.search(r"^tool_choice auto: [0-2] of 2 round-1 questions answered with a call, [0-2] naming", out,
                     re.M), out


def test_tools_bench_takes_the_reuse_policy(tiny_llama, bench):
    """Shared answers shorter than --min-shared-tokens are computed, not read from cache:
    round 2's calls (each quoting the other agent's 4-token answer) reuse fewer tokens."""
    def cached_calls(*extra: str) -> tuple[str, int]:
        out = bench(tools_bench, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2", "--repeats", "1",
                    "--max-tokens", "4", *extra)
        row = re.search(r"^\| 2 \| collective \| 2 \| .* \| ([\d,]+) / [\d,]+ \(\d+%\) \| [\d,]+ / [\d,]+ \(\d+%\) \|$",
                        out, re.M)
        assert row, out
        return out, int(row[1].replace(",", ""))

    out, reused = cached_calls("--min-shared-tokens", "0")
    assert "recompute ratio 0.15, standalone bases, shared segments reused from 0 tokens" in out
    out, plain = cached_calls("--min-shared-tokens", "1000", "--recompute-ratio", "0.3")
    assert "recompute ratio 0.3, standalone bases, shared segments reused from 1000 tokens" in out
    assert plain < reused, (plain, reused, out)
