"""`bench speculate` runs a debate with n-gram speculation and without: its table counts
steps, drafts and answers equal to those of the engine without."""

from __future__ import annotations

import re

from tokendance.bench import speculate


def test_speculate_bench_counts_drafts_and_equal_answers(tiny_llama, bench):
    out = bench(speculate, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2", "--max-tokens", "40",
                "--tokens", "3", "--lookup-min", "1", "--lookup-max", "3", "--repeats", "1")
    rows = {r[0]: [int(x.replace(",", "")) for x in r[1:]] for r in re.findall(
        r"^\| (off|3 tokens) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+)(?: \(\d+%\))? \| (\d+)/4 \|",
        out, re.M)}
    assert set(rows) == {"off", "3 tokens"}, out
    tokens, steps, drafts, drafted, accepted, same = rows["3 tokens"]
    assert rows["off"][2:5] == [0, 0, 0] and tokens == rows["off"][0] <= 4 * 40, out
    assert 0 < accepted <= drafted <= 3 * drafts and same == 4, out
    assert steps <= rows["off"][1], out  # a batch ends with its longest answer
    assert out.rstrip().endswith("x |")


def test_speculate_bench_times_a_step_by_drafts(tiny_llama, bench):
    out = bench(speculate, "--model", str(tiny_llama), "--no-debate", "--cost", "2x40", "--tokens", "2",
                "--repeats", "1")
    assert "debate of" not in out
    row = re.search(r"^\| 2 x 40 \| ([\d.]+) \| ([\d.]+) \(([\d.]+)x\) \| ([\d.]+) \(([\d.]+)x\) \|$", out, re.M)
    assert row, out
    base, one, x1, two, x2 = map(float, row.groups())
    assert base > 0 and abs(one / base - x1) < 0.05 and abs(two / base - x2) < 0.05


def test_speculate_bench_needs_something_to_run(tiny_llama, bench):
    import pytest

    with pytest.raises(ValueError, match="nothing to run"):
        bench(speculate, "--model", str(tiny_llama), "--no-debate")


def test_speculate_bench_samples_at_a_temperature(tiny_llama, bench):
    out = bench(speculate, "--model", str(tiny_llama), "--agents", "2", "--rounds", "1", "--max-tokens", "16",
                "--tokens", "2", "--temperature", "0.8", "--repeats", "1")
    assert "temperature 0.8" in out and re.search(r"^\| 2 tokens \| [\d,]+ \|", out, re.M), out
