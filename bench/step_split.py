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


def breakdown(eng: Engine, prompts: list[list[int]], steps: int, top: int = 8) -> str:
    """A table of medians over `steps` decode steps and, on CUDA, the top kernels."""
    for i, p in enumerate(prompts):
        eng.add(f"b{i}", p, SamplingParams(max_tokens=2 * steps + 8, temperature=0, ignore_eos=True))
    while any(s.computed < len(s.prompt) or not s.out for s in eng.seqs.values()):
        eng.step()
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
        busy, table = kernels(eng, steps, top)
        lines += [f"| GPU busy (kernels and copies) | {busy:.2f} |",
                  f"| wall - GPU busy (the GPU waits on the host) | {ms(wall) - busy:.2f} |", "", table]
    while eng.has_work():
        eng.step()
    return "\n".join(lines)


def kernels(eng: Engine, steps: int, top: int) -> tuple[float, str]:
    """(GPU milliseconds a step, the top kernels) over `steps` more steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    return busy, (f"GPU time by kernel over {steps} steps:\n"
                  + events.table(sort_by="self_device_time_total", row_limit=top))
