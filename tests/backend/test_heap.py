"""backend/heap.py: with the heap kept, memory torch frees is reused without page faults.
Each case runs in a fresh interpreter: malloc settings are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokendance.backend import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="glibc only")

PROBE = """
import resource, sys, threading
import torch
from tokendance.backend import heap
if sys.argv[1] == "keep":
    assert heap.keep()
faults = []
def forward():  # a fresh 64 MiB activation, written, freed, six times
    for _ in range(6):
        x = torch.ones(16 * 2**20)
        del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        x = torch.ones(16 * 2**20)
        del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=forward)  # as the server's engine thread does
t.start(); t.join()
print(faults[0])
"""


PAGES = 6 * 64 * 2**20 // 4096  # what six fresh 64 MiB buffers fault in, 4 KiB pages


def faults(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return int(out.stdout.split()[-1])


def test_kept_heap_reuses_freed_memory_without_faults():
    assert faults("default") > PAGES // 2  # glibc maps and unmaps each one
    assert faults("keep") < PAGES // 20


def test_vllm_baseline_gets_the_same_heap_through_glibc_environment():
    # bench/vllm_cpu.py cannot import tokendance: it spells heap.KEEP as glibc's variables
    from tokendance.bench.vllm_cpu import HEAP_ENV

    keep = dict(heap.KEEP)
    assert HEAP_ENV == {"MALLOC_MMAP_MAX_": str(keep[heap.M_MMAP_MAX]),
                        "MALLOC_TRIM_THRESHOLD_": str(keep[heap.M_TRIM_THRESHOLD]),
                        "MALLOC_ARENA_MAX": str(keep[heap.M_ARENA_MAX])}
    # Set from the environment, glibc at times faults one of the six buffers in again
    # (16,384 pages: in about one run of four under pytest on the Intel host, never in a
    # plain loop of the same probe); the default heap faults in all six.
    assert faults("default", HEAP_ENV) < PAGES // 4


TRIM = """
import os, torch
from tokendance.backend import heap
assert heap.keep()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
x = torch.ones(64 * 2**20)  # 256 MiB
del x
kept = rss()
heap.trim()
print(kept - rss())
"""


def test_trim_hands_back_what_the_heap_kept():
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 200  # MiB of the freed 256 back to the system


def test_engine_on_cpu_keeps_the_heap_and_trims_what_loading_left(tiny_llama, monkeypatch):
    from tokendance.backend.engine import Engine

    calls = []
    monkeypatch.setattr(heap, "keep", lambda: calls.append("keep") or True)
    monkeypatch.setattr(heap, "trim", lambda: calls.append("trim"))
    Engine(model=str(tiny_llama), dtype="float32", kv_tokens=256)
    assert calls == ["keep", "trim"]


def test_frozen_puts_the_startup_heap_out_of_the_collectors_reach_while_it_lasts():
    import gc

    with heap.frozen() as n:
        assert n > 1000  # this process's modules, at least
        gc.collect()
        assert gc.get_freeze_count() > n // 2  # a collection leaves it frozen
    assert gc.get_freeze_count() == 0
