"""`tokendance bench memory`: the process's resident memory around serving a batch."""

from __future__ import annotations

import re

from tokendance.bench import memory


def test_memory_bench_reports_the_pool_and_the_process_rss(bench, tiny_llama):
    out = bench(memory, "--model", str(tiny_llama), "--dtype", "float32", "--kv-tokens", "512", "--requests", "2")
    head = re.search(r"^model (.+), float32, pool 512 tokens \((\d+) MiB\)$", out, re.M)
    assert head is not None
    loaded, served, peak = map(float, re.search(r"^\| (\d+) MiB \| (\d+) MiB \| (\d+) MiB \|$", out, re.M).groups())
    assert 0 < loaded <= peak and 0 < served <= peak
