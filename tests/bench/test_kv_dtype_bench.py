"""`bench kv-dtype` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

import re

from tokendance.bench import kv_dtype


def test_kv_dtype_bench_compares_the_pools(tiny_llama, bench):
    out = bench(kv_dtype, "--model", str(tiny_llama), "--questions", "1", "--agents", "2", "--tokens", "4",
                "--decode", "2x64", "--steps", "2", "--repeats", "1", "--kv-tokens", "4096")
    wide, narrow = (int(re.search(rf"\| {p} \| ([\d,]+) \|", out)[1].replace(",", "")) for p in ("float32", "fp8"))
    assert wide == 4 * narrow
    row = re.search(r"\| ([\d.]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| (\d)/2 \| ", out)
    assert 0 <= float(row[1]) <= 1 and 0 <= float(row[2]) <= float(row[3])
    assert re.search(r"\| 2 x 64 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", out)


def test_a_shape_times_decode_steps_alone(monkeypatch, bench, tiny_llama):
    """Random weights (a shape name): no prompts to judge, the decode steps alone."""
    monkeypatch.setattr(kv_dtype, "resolve", lambda model: (str(tiny_llama), True))
    out = bench(kv_dtype, "--model", "tiny", "--decode", "2x32", "--steps", "2", "--repeats", "1",
                "--kv-tokens", "4096")
    assert "teacher-forced" not in out and re.search(r"\| 2 x 32 \|", out)
