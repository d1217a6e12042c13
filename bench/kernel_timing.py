"""What the GPU kernel benchmarks (bench/kernels.py, bench/collective.py) share: a log
that prints and keeps its lines, median timings, relative error, and the statistics of
compiled kernels. A --smoke run sets TRITON_INTERPRET=1 before importing this."""

from __future__ import annotations

import math
import os
import time

import torch
import triton

COPY_CEILING = 4.1e12  # bytes/s, device-to-device copy measured on the H200
T0 = time.time()
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def save_log(name: str) -> None:
    """The log into $OUT/name, when OUT is set (files the device tool brings back)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            f.write("\n".join(LOG) + "\n")


def median_ms(fn, smoke: bool) -> float:
    """Median milliseconds (do_bench clears L2 between calls: the bytes come from HBM);
    under the interpreter, one timed call after a warm-up."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.isnan().any():
        return math.inf
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernel_stats(kernels) -> None:
    """Registers, spills and shared memory of every compiled variant (best effort)."""
    for kern in kernels:
        try:
            for cache in kern.device_caches.values():
                for ck in cache[0].values():
                    md = ck.metadata
                    consts = getattr(getattr(ck, "src", None), "constants", None)
                    say(f"  {kern.fn.__name__}: regs {ck.n_regs} spills {ck.n_spills} "
                        f"smem {md.shared} warps {md.num_warps} stages {md.num_stages} "
                        f"{consts or ''}")
        except Exception as e:
            say(f"  {kern.fn.__name__}: no stats ({type(e).__name__}: {e})")
