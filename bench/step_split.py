"""Where a decode step's wall time goes: GPU busy time (the step's kernels and copies,
from the torch profiler) against the host work the GPU waits for (scheduling, filling
graph inputs, sampling, detokenizing, stop checks), and the step's top kernels.
`tokendance bench engine --breakdown`."""

from __future__ import annotations

import statistics
import time

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine


def prefilled(eng: Engine, prompts, shared, mode: str, steps: int,
              warm: list[int] | None = None) -> None:
    """Cold caches, then the prompts prefilled (first token out) with more than `steps`
    tokens to go. `warm`: tokens run first, to completion, so that prompts starting with
    them find their blocks in `prefix` mode's cache."""
    eng.reset_caches()
    if warm:
        eng.generate([warm], SamplingParams(max_tokens=1, temperature=0), mode=mode)
    sampling = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(prompts, shared)):
        eng.add(f"d{i}", p, sampling, mode=mode, shared=sp)
    while any(s.computed < len(s.prompt) or not s.out for s in eng.seqs.values()):
        eng.step()


def breakdown(eng: Engine, prompts: list[list[int]], steps: int, top: int = 8) -> str:
    """A table of medians over `steps` decode steps and, on CUDA, the top kernels."""
    prefilled(eng, prompts, [[] for _ in prompts], "full", 2 * steps + 6)
    run = eng.runner.run
    enqueue: list[float] = []

    def timed_run(work, ids=None):
        t0 = time.perf_counter()
        out = run(work, ids)
        enqueue.append(time.perf_counter() - t0)
        return out

    wall = []
    eng.runner.run = timed_run
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            wall.append(time.perf_counter() - t0)
    finally:
        eng.runner.run = run
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    lines = [f"decode step, batch {len(prompts)}: medians over {steps} steps",
             "| measure | ms |", "|---|---|",
             f"| wall time of a step | {ms(wall):.2f} |",
             f"| host time in the runner (inputs, launch; the forward on a CPU) | {ms(enqueue):.2f} |"]
    if eng.device.type == "cuda":
        busy, table = profile_steps(eng, steps, top)
        lines += [f"| GPU busy (kernels and copies) | {busy:.2f} |",
                  f"| wall - GPU busy (the GPU waits on the host) | {ms(wall) - busy:.2f} |", "",
                  f"GPU time by kernel over {steps} steps:\n{table}"]
    while eng.has_work():
        eng.step()
    return "\n".join(lines)


def profile_steps(eng: Engine, steps: int, top: int) -> tuple[float, str]:
    """(device milliseconds a step, the top ops by device time: GPU kernels on CUDA, CPU
    ops elsewhere) over `steps` more steps."""
    busy, table = profiled(eng, lambda: [eng.step() for _ in range(steps)], top)
    return busy / steps, table


def _profile(eng: Engine, fn, stacks: bool = False):
    """One call of fn under the torch profiler (CPU ops, and the device's on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, with_stack=stacks) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof


def profiled(eng: Engine, fn, top: int) -> tuple[float, str]:
    """(device milliseconds fn keeps busy, the top ops by device time) of one call."""
    from torch.autograd import DeviceType

    events = _profile(eng, fn).key_averages()
    if eng.device.type == "cuda":  # the kernels and copies themselves: an op's self device time repeats its kernels'
        key = "self_device_time_total"
        busy = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)
    else:
        key = "self_cpu_time_total"
        busy = sum(e.self_cpu_time_total for e in events)
    return busy / 1e3, events.table(sort_by=key, row_limit=top)


def traced(eng: Engine, fn, path: str) -> None:
    """One call of fn under the profiler with Python stacks, its chrome trace written to
    path (gzipped when it ends in .gz), for bench/gaps.py. Apart from `profiled`: the
    stack tracer slows the host, so busy shares come from runs without it."""
    _profile(eng, fn, stacks=True).export_chrome_trace(path)
