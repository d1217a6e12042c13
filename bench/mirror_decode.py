"""Decode steps over N Mirrors of one round against N dense caches and one dense cache.

One All-Gather round whose shared outputs total `--shared` tokens (2k by default) and
histories of `--history` tokens: the N agents are prefilled in `collective` mode (each a
Mirror of the round's Master) or in `full` mode (each a dense cache); a single agent's
dense cache is the floor. Decode step time: the median over windows of 8 steps (CUDA
graphs on). With `--profile`, the same steps again without graphs under the torch
profiler: GPU time per kernel, to see where a Mirror step spends what a dense one does
not.

    tokendance bench mirror-decode --model qwen2.5-7b --agents 10,20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokendance.backend.engine import Engine
from tokendance.bench.allgather import make_round
from tokendance.bench.options import counts, natural, positive
from tokendance.bench.shapes import round_engine
from tokendance.bench.step_split import prefilled, profile_steps


def sync(eng: Engine) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize()


def decode_steps(eng: Engine, prompts, shared, mode: str, steps: int, window: int = 8) -> list[float]:
    """Seconds a decode step takes, averaged over windows of `window` steps run back to
    back (a step's host work overlaps the GPU's, backend/lookahead.py: a sync per step
    would hide that), after the prompts are prefilled (first token out)."""
    prefilled(eng, prompts, shared, mode, steps)
    window = min(window, steps)
    times = []
    for _ in range(steps // window):
        sync(eng)
        t0 = time.perf_counter()
        for _ in range(window):
            eng.step()
        sync(eng)
        times.append((time.perf_counter() - t0) / window)
    while eng.has_work():
        eng.step()
    return times


def kernel_table(eng: Engine, prompts, shared, mode: str, steps: int, top: int = 8) -> str:
    """The top kernels of `steps` decode steps run eagerly (graphs off)."""
    graphs, eng.runner.graphs = eng.runner.graphs, None
    try:
        prefilled(eng, prompts, shared, mode, steps)
        table = profile_steps(eng, steps, top)[1]
        while eng.has_work():
            eng.step()
    finally:
        eng.runner.graphs = graphs
    return table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (qwen2.5-7b)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--agents", type=counts, default="10,20", help="N, comma list")
    p.add_argument("--shared", type=positive, default=2048, help="tokens of all outputs together")
    p.add_argument("--history", type=natural, default=512)
    p.add_argument("--steps", type=positive, default=32)
    p.add_argument("--profile", action="store_true")


def main(args: argparse.Namespace) -> int:
    agents = args.agents
    need = max(agents) * (args.history * 2 + args.shared * 2 + args.steps + 64) + 8192
    eng, vocab = round_engine(args.model, args.dtype, need)
    print(f"model {eng.name} on {eng.device}, {eng.dtype}; shared {args.shared} tokens per round, "
          f"histories ~{args.history}; decode step, median over windows of 8 of {args.steps} steps")
    print("| N | N Mirrors (collective) | N dense caches (full) | one dense cache | Mirrors / dense | "
          "Mirrors / one |\n|---|---|---|---|---|---|")
    for n in agents:
        rnd = make_round(n, args.history, args.shared // n, vocab, seed=n)
        decode_steps(eng, rnd.prompts[:1], rnd.shared[:1], "full", 2)  # warm-up
        ms = {}
        for name, mode, k in (("mirrors", "collective", n), ("dense", "full", n), ("one", "full", 1)):
            ms[name] = 1e3 * statistics.median(
                decode_steps(eng, rnd.prompts[:k], rnd.shared[:k], mode, args.steps))
        print(f"| {n} | {ms['mirrors']:.2f} ms | {ms['dense']:.2f} ms | {ms['one']:.2f} ms | "
              f"{ms['mirrors'] / ms['dense']:.2f}x | {ms['mirrors'] / ms['one']:.2f}x |")
        if args.profile:
            for mode in ("collective", "full"):
                print(f"\nN = {n}, {mode}, eager, time per op on the device over {args.steps} steps:")
                print(kernel_table(eng, rnd.prompts, rnd.shared, mode, args.steps))
    return 0
