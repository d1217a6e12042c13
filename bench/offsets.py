"""`tokendance bench offsets`: how close kvcomm's predicted K/V come to exact.

A debate (bench/fidelity.py's prompts, `full`'s answers): each agent's round-2 prompt is
prefilled exactly, and each of its shared segments gives an anchor (exact K/V - base,
backend/anchors.py) at its placeholder. The same agent's round-3 segments are then
predicted from them, by each rule, and compared with the exact K/V of the round-3
prompt: the mean relative L2 distance of V (and K) per layer, over every segment.

Rules: the bare base (nothing predicted: `pic` with nothing recomputed); KVCOMM's (the
placeholder's anchor, token t for token t, as far as the anchor reaches); the nearest
token of the placeholder's anchors (kvcomm's rule, backend/anchors.py); the nearest
token of the agent's every placeholder; and kvcomm's rule kept only on the share of
tokens with the largest offsets (`--patches`), the base elsewhere: what a Mirror would
hold if kvcomm's offsets were its patches and every other token read the Master; and
kvcomm's rule over anchors held at each rank of `--ranks` (KVCMAS's low-rank anchors,
backend/lowrank.py), with the bytes its anchors hold against full ones.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from tokendance.backend.anchors import Anchors
from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.lowrank import factor
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.service import EngineBackend
from tokendance.bench.debates import QUESTIONS, Board, debate
from tokendance.bench.fidelity import layer_kv, run
from tokendance.bench.options import counts, positive, shares

Rule = Callable[[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int], torch.Tensor]


def exact(eng: Engine, ids: list[int]) -> torch.Tensor:
    """[layers from the check layer, 2, T, H, D]: the K/V of ids prefilled alone, exactly."""
    eng.add("offsets", ids, SamplingParams(max_tokens=1), mode="full")
    seq = eng.seqs["offsets"]
    assert eng.blocks.reserve(seq, len(ids))
    eng.runner.run([Scheduled(seq, 0, len(ids))])
    kv = layer_kv(eng, seq)[eng.collector.cfg.check_layer:]
    eng.abort("offsets")
    eng.blocks.free(seq)
    return kv


def kvcomm_index(base: torch.Tensor, anchors: list[tuple[torch.Tensor, torch.Tensor]], j: int) -> torch.Tensor:
    _, off = anchors[j]
    m = min(base.shape[2], off.shape[2])
    out = torch.zeros_like(base)
    out[:, :, :m] = off[:, :, :m]
    return out


def pool(anchors: list[tuple[torch.Tensor, torch.Tensor]], every: bool = False, rank: int = 0) -> Anchors:
    """The agent's anchors, each at its own place (or all at one, `every`), at `rank`."""
    out = Anchors(per=len(anchors), budget=1 << 40)
    for i, (b, off) in enumerate(anchors):
        out.add(("", "", 0 if every else i), factor(off, rank), factor(b, rank))
    return out


def nearest(base: torch.Tensor, anchors: list[tuple[torch.Tensor, torch.Tensor]], j: int | None,
            rank: int = 0) -> torch.Tensor:
    return pool(anchors, j is None, rank).offsets([("", "", 0 if j is None else j)], base, [base.shape[2]])


def largest(offset: torch.Tensor, share: float) -> torch.Tensor:
    """offset ([layers, 2, T, H, D]) on the ceil(share * T) tokens whose offsets are
    largest (L2 over every layer, K and V), zero on the others."""
    t = offset.shape[2]
    norm = offset.float().pow(2).sum(dim=(0, 1, 3, 4))
    keep = torch.zeros(t, dtype=torch.bool)
    keep[norm.topk(min(t, math.ceil(share * t))).indices] = True
    return offset * keep.view(1, 1, -1, 1, 1)


RULES: dict[str, Rule] = {
    "base alone": lambda base, anchors, j: torch.zeros_like(base),
    "KVCOMM's (token t of the placeholder's anchor)": kvcomm_index,
    "nearest token of the placeholder's anchors (kvcomm)": nearest,
    "nearest token of every placeholder's": lambda base, anchors, j: nearest(base, anchors, None),
}


def rules(patches: list[float], ranks: list[int] = ()) -> dict[str, Rule]:
    """RULES, then kvcomm's rule as patches on each share of the tokens, then over
    anchors at each rank."""
    out = dict(RULES)
    for p in patches:
        out[f"kvcomm's, on the {p:.0%} of tokens with the largest offsets"] = (
            lambda base, anchors, j, p=p: largest(nearest(base, anchors, j), p))
    for r in ranks:
        out[f"kvcomm's, anchors at rank {r}"] = lambda base, anchors, j, r=r: nearest(base, anchors, j, r)
    return out


def measure(eng: Engine, be: EngineBackend, agents: int, questions: int, tokens: int,
            patches: list[float], ranks: list[int] = ()) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Per rule: [2 (V, K), layers from the check layer] mean relative distances; per
    rank (0: full), the bytes the round-2 anchors hold."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0)
    table = rules(patches, ranks)
    devs: dict[str, list[torch.Tensor]] = {r: [] for r in table}
    held = dict.fromkeys([0, *ranks], 0)
    for k in range(min(questions, len(QUESTIONS))):
        eng.reset_caches()
        b = Board(debate("bench", agents, k))
        b.observe(run(eng, b.requests(be, "full", greedy), "full"))
        second = b.requests(be, "full", greedy)
        b.observe(run(eng, second, "full"))
        third = b.requests(be, "full", greedy)
        for p2, p3 in zip(second, third):
            whole = exact(eng, p2.state.ids)
            anchors = []
            for lo, hi in p2.state.shared:
                b = exact(eng, p2.state.ids[lo:hi])
                anchors.append((b, whole[:, :, lo:hi] - b))
            for r in held:
                held[r] += pool(anchors, rank=r).nbytes
            whole = exact(eng, p3.state.ids)
            for j, (lo, hi) in enumerate(p3.state.shared[:len(anchors)]):
                base, want = exact(eng, p3.state.ids[lo:hi]), whole[:, :, lo:hi]
                for name, rule in table.items():
                    got = base + rule(base, anchors, j)
                    dist = [(got[:, kv] - want[:, kv]).flatten(2).norm(dim=-1)
                            / want[:, kv].flatten(2).norm(dim=-1).clamp_min(1e-9) for kv in (1, 0)]
                    devs[name].append(torch.stack([d.mean(-1) for d in dist]))
    return {name: torch.stack(d).mean(0) for name, d in devs.items() if d}, held


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--agents", type=positive, default=4)
    p.add_argument("--questions", type=positive, default=2)
    p.add_argument("--max-tokens", type=positive, default=48)
    p.add_argument("--patches", type=shares, default="0.15,0.5",
                   help="shares of tokens that keep kvcomm's offset as patches, comma list")
    p.add_argument("--ranks", type=counts, default="8,16,32",
                   help="ranks its anchors are held at (KVCMAS's low-rank anchors), comma list")


def main(args: argparse.Namespace) -> int:
    eng = Engine(EngineConfig(model=args.model, dtype="float32", kv_tokens=65536))
    res, held = measure(eng, EngineBackend(eng), args.agents, args.questions, args.max_tokens, args.patches,
                        args.ranks)
    c = eng.collector.cfg.check_layer
    layers = eng.mcfg.num_layers
    picks = sorted(x for x in {c, c + 1, 5, 10, layers // 2, layers - 1} if c <= x < layers)
    print(f"model {eng.name}, float32; {args.agents} agents, {args.questions} question(s), round-3 segments "
          "predicted from round-2 anchors; mean relative distance from the exact K/V")
    for w, what in enumerate("VK"):
        print(f"\n{what}:\n| rule | " + " | ".join(f"layer {x}" for x in picks) + " |\n|---|" + "---|" * len(picks))
        for name, d in res.items():
            print(f"| {name} | " + " | ".join(f"{d[w, x - c]:.3f}" for x in picks) + " |")
    print("\nround-2 anchors held: full " + f"{held[0]:,} bytes" + "".join(
        f"; rank {r} {n:,} ({held[0] / max(n, 1):.2f}x less)" for r, n in held.items() if r))
    return 0
