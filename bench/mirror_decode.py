"""Decode steps over N Mirrors of one round against N dense caches and one dense cache.

One All-Gather round whose shared outputs total `--shared` tokens (2k by default) and
histories of `--history` tokens: the N agents are prefilled in `collective` mode (each a
Mirror of the round's Master) or in `full` mode (each a dense cache); a single agent's
dense cache is the floor. A fourth case holds the shared part as vLLM's prefix cache
would if every agent saw it at the same offset: the outputs, in one order, start every
prompt (history and question after them), and the N agents' tables share its blocks
(`prefix` mode): N agents over one dense copy of the shared part, each with its private
part, which is what Mirrors do at any offsets. Decode step time: the median over
windows of 8 steps (CUDA graphs on). A second table gives the bytes each step must read at least (every linear
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
from tokendance.bench.allgather import Round, make_round
from tokendance.bench.options import counts, natural, positive
from tokendance.bench.shapes import round_engine
from tokendance.bench.step_split import prefilled, profile_steps
from tokendance.kernels.packed import PackedLinear


def kv_read(eng: Engine, master: int) -> int:
    """Tokens of K/V the running batch's next decode step reads at least: each dense
    sequence its whole cache less the full blocks an earlier one already read (a shared
    prefix), each Mirror its private slots, and the round's Master (`master` tokens) once
    for all Mirrors (kernels/collective.py)."""
    seqs, seen, own = list(eng.seqs.values()), set(), 0
    size = eng.cfg.block_size
    for s in seqs:
        if s.mirror is not None:
            own += s.mirror.held(len(s))
            continue
        full = s.blocks[: len(s) // size]
        own += len(s) - size * sum(b in seen for b in full)
        seen.update(full)
    return own + (master if any(s.mirror is not None for s in seqs) else 0)


def prefix_round(rnd: Round) -> tuple[list[list[int]], list[int]]:
    """The round's prompts with the shared outputs moved to the front, in one order for
    every agent: (prompts, that common prefix)."""
    first = rnd.prompts[0]
    common = [t for lo, hi in sorted(rnd.shared[0]) for t in first[lo:hi]]
    prompts = []
    for p, spans in zip(rnd.prompts, rnd.shared):
        cut = set().union(*(range(lo, hi) for lo, hi in spans))
        prompts.append(common + [t for j, t in enumerate(p) if j not in cut])
    return prompts, common


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer's, the LM head's
    included; not the embedding table's (a step reads one row of it per sequence)."""
    mats = [m.weight if isinstance(m, nn.Linear) else m.packed
            for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    return sum(w.numel() * w.element_size() for w in mats)


def decode_steps(eng: Engine, prompts, shared, mode: str, steps: int, window: int = 8,
                 master: int = 0, warm: list[int] | None = None) -> tuple[list[float], int]:
    """Seconds a decode step takes, averaged over windows of `window` steps run back to
    back (a step's host work overlaps the GPU's, backend/lookahead.py: a sync per step
    would hide that), after the prompts are prefilled (first token out; `warm` first, see
    `prefilled`); and the tokens of K/V the first timed step reads (`kv_read`)."""
    prefilled(eng, prompts, shared, mode, steps, warm)
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
    print("| N | N Mirrors (collective) | N dense caches (full) | N on one shared prefix (prefix) | "
          "one dense cache | Mirrors / dense | Mirrors / shared prefix | Mirrors / one |\n"
          "|---|---|---|---|---|---|---|---|")
    weights, moved = weight_bytes(eng.model), []
    for n in agents:
        rnd = make_round(n, args.history, args.shared // n, vocab, seed=n)
        decode_steps(eng, rnd.prompts[:1], rnd.shared[:1], "full", 2)  # warm-up
        front, common = prefix_round(rnd)
        cases = (("mirrors", "collective", rnd.prompts, rnd.shared, None),
                 ("dense", "full", rnd.prompts, rnd.shared, None),
                 ("prefix", "prefix", front, [[] for _ in front], common),
                 ("one", "full", rnd.prompts[:1], rnd.shared[:1], None))
        ms = {}
        for name, mode, prompts, shared, warm in cases:
            times, tokens = decode_steps(eng, prompts, shared, mode, args.steps,
                                         master=rnd.shared_tokens, warm=warm)
            ms[name] = 1e3 * statistics.median(times)
            moved.append((n, name, tokens * eng.kv_bytes_per_token, ms[name]))
        m = ms["mirrors"]
        print(f"| {n} | {m:.2f} ms | {ms['dense']:.2f} ms | {ms['prefix']:.2f} ms | {ms['one']:.2f} ms | "
              f"{m / ms['dense']:.2f}x | {m / ms['prefix']:.2f}x | {m / ms['one']:.2f}x |")
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
