"""Decode steps over N Mirrors of one round against N dense caches and one dense cache.

One All-Gather round whose shared outputs total `--shared` tokens (2k by default) and
histories of `--history` tokens: the N agents are prefilled in `collective` mode (each a
Mirror of the round's Master) or in `full` mode (each a dense cache); a single agent's
dense cache is the floor. Decode step time: the median over windows of 8 steps (CUDA
graphs on). A second table gives the bytes each step must read at least (every linear
layer's weights, then the K/V: each dense cache whole, each Mirror's private slots and
the Master once) and the rate its time gives, to hold against the GPU's copy ceiling.
With `--profile`, the same steps again without graphs under the torch profiler: GPU
time per kernel, to see where a Mirror step spends what a dense one does not.

    tokendance bench mirror-decode --model qwen2.5-7b --agents 10,20
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch import nn

from tokendance.backend.device import sync
from tokendance.backend.engine import Engine
from tokendance.bench.allgather import make_round
from tokendance.bench.options import counts, natural, positive
from tokendance.bench.shapes import round_engine
from tokendance.bench.step_split import prefilled, profile_steps
from tokendance.kernels.packed import PackedLinear


def kv_read(eng: Engine, master: int) -> int:
    """Tokens of K/V the running batch's next decode step reads: each dense sequence its
    whole cache, each Mirror its private slots, and the round's Master (`master` tokens)
    once for all Mirrors (kernels/collective.py)."""
    seqs = list(eng.seqs.values())
    own = sum(s.mirror.held(len(s)) if s.mirror is not None else len(s) for s in seqs)
    return own + (master if any(s.mirror is not None for s in seqs) else 0)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer's, the LM head's
    included; not the embedding table's (a step reads one row of it per sequence)."""
    mats = [m.weight if isinstance(m, nn.Linear) else m.packed
            for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    return sum(w.numel() * w.element_size() for w in mats)


def decode_steps(eng: Engine, prompts, shared, mode: str, steps: int, window: int = 8,
                 master: int = 0) -> tuple[list[float], int]:
    """Seconds a decode step takes, averaged over windows of `window` steps run back to
    back (a step's host work overlaps the GPU's, backend/lookahead.py: a sync per step
    would hide that), after the prompts are prefilled (first token out); and the tokens
    of K/V the first timed step reads (`kv_read`)."""
    prefilled(eng, prompts, shared, mode, steps)
    tokens = kv_read(eng, master)
    window = min(window, steps)
    times = []
    for _ in range(steps // window):
        sync(eng.device)
        t0 = time.perf_counter()
        for _ in range(window):
            eng.step()
        sync(eng.device)
        times.append((time.perf_counter() - t0) / window)
    while eng.has_work():
        eng.step()
    return times, tokens


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
    weights, moved = weight_bytes(eng.model), []
    for n in agents:
        rnd = make_round(n, args.history, args.shared // n, vocab, seed=n)
        decode_steps(eng, rnd.prompts[:1], rnd.shared[:1], "full", 2)  # warm-up
        ms = {}
        for name, mode, k in (("mirrors", "collective", n), ("dense", "full", n), ("one", "full", 1)):
            times, tokens = decode_steps(eng, rnd.prompts[:k], rnd.shared[:k], mode, args.steps,
                                         master=rnd.shared_tokens)
            ms[name] = 1e3 * statistics.median(times)
            moved.append((n, name, tokens * eng.kv_bytes_per_token, ms[name]))
        print(f"| {n} | {ms['mirrors']:.2f} ms | {ms['dense']:.2f} ms | {ms['one']:.2f} ms | "
              f"{ms['mirrors'] / ms['dense']:.2f}x | {ms['mirrors'] / ms['one']:.2f}x |")
        if args.profile:
            for mode in ("collective", "full"):
                print(f"\nN = {n}, {mode}, eager, time per op on the device over {args.steps} steps:")
                print(kernel_table(eng, rnd.prompts, rnd.shared, mode, args.steps))
    print(f"\nBytes a step must read at least ({weights / 1e9:.2f} GB of weights, then K/V) and "
          f"the rate the step time gives:\n| N | case | K/V read | bytes / step | rate |\n|---|---|---|---|---|")
    for n, name, kv, t in moved:
        print(f"| {n} | {name} | {kv / 1e6:,.1f} MB | {(weights + kv) / 1e9:.2f} GB | "
              f"{(weights + kv) / t / 1e9:.2f} TB/s |")
    return 0
