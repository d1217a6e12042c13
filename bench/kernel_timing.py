"""What the GPU kernel benchmarks (bench/kernels.py, bench/collective.py, ...) share: a log
that prints and keeps its lines, median timings, relative error, and the statistics of
compiled kernels. A --smoke run sets TRITON_INTERPRET=1 before importing this."""

from __future__ import annotations

import itertools
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


def summary(log: str, ok: bool, rows: list[str]) -> int:
    """The log saved (`save_log`), then a summary: correctness and each timed row. Returns
    the exit status: 1 when a check failed."""
    save_log(log)
    print("\n==== summary ====")
    print(f"correctness: {'all ok' if ok else 'FAILURES'}")
    for r in rows:
        print(r)
    print(f"total {time.time() - T0:.0f} s")
    return 0 if ok else 1


def median_ms(fn, smoke: bool) -> float:
    """Median milliseconds (do_bench clears L2 between calls: the bytes come from HBM);
    under the interpreter (nothing compiles, nothing is warm), one timed call."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def wall_ms(fn, smoke: bool, calls: int = 20, repeats: int = 7) -> float:
    """Median wall milliseconds a call over `calls` back to back, the host's launches
    included (what an eager step pays; `median_ms` times the device); under the
    interpreter, one call after one warm-up."""
    calls, repeats = (1, 1) if smoke else (calls, repeats)
    cuda = torch.cuda.is_available() and not smoke
    for _ in range(1 if smoke else 5):
        fn()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / calls * 1e3)
    return sorted(ts)[len(ts) // 2]


LAUNCHES = 28  # a decode step's layers, in `graph_ms`'s graph


def layers(tensors: tuple[torch.Tensor, ...], n: int = LAUNCHES) -> list[tuple[torch.Tensor, ...]]:
    """`tensors` and n - 1 copies of them: a weight per layer of a step, as a model's layers
    each read their own (one weight read 28 times over stays in the L2 where it fits: an
    H100's 50 MiB holds a 4,096-wide o projection's 32 MiB in bf16)."""
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def each(fn, sets: list[tuple[torch.Tensor, ...]]):
    """fn called with the next of `sets` at each call: in `graph_ms`'s graph of LAUNCHES
    calls every layer's copy is read once."""
    turn = itertools.count()
    return lambda: fn(*sets[next(turn) % len(sets)])


def graph_ms(fn, smoke: bool, launches: int = LAUNCHES, replays: int = 30) -> float:
    """Median milliseconds of one call of fn inside a CUDA graph of `launches` calls (a
    decode step's layers: what the engine replays, without per-launch host overhead);
    under the interpreter, `median_ms`."""
    if smoke:
        return median_ms(fn, smoke)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    return sorted(times)[len(times) // 2]


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
