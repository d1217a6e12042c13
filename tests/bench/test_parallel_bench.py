"""`bench parallel`: each tensor-parallel size in turn, against the first."""

from __future__ import annotations

import re

import pytest

from tokendance.bench import parallel as parallel_bench
from tokendance.bench.check_parallel import death


def test_sizes_one_and_two(tiny_llama, bench):
    out = bench(parallel_bench, "--model", str(tiny_llama), "--dtype", "float32", "--sizes", "1,2",
                "--prefill", "2x32", "--decode", "2x32", "--steps", "2", "--agents", "3", "--history", "24",
                "--output", "12", "--repeats", "1")
    assert "| what | size 1 | size 2 |" in out
    for what in ("prefill 2x32", "decode batch 2, context 32", "All-Gather round N = 3, full (first token)",
                 "All-Gather round N = 3, collective (first token)"):
        assert re.search(rf"\| {re.escape(what)} \| [\d,]+ \S+ \| [\d,]+ \S+ \(\d+\.\d\dx\) \|", out), what


def test_a_size_needs_its_batches(tiny_llama, bench):
    with pytest.raises(ValueError, match="--prefill and --decode each need a BATCHxLEN"):
        bench(parallel_bench, "--model", str(tiny_llama), "--prefill", "")


def test_a_follower_killed_mid_step_is_timed_and_named(tiny_llama):
    took, err = death(str(tiny_llama), "cpu")
    assert 0 <= took < 10 and err == "ChildProcessError: tensor-parallel rank tokendance-tp1 exited (code -9)"
