"""Restoring a round's idle agents from the host tier: fused (Master once + private
diffs) against dense (every agent's whole cache), through the same HostTier.

The workload is the All-Gather round of `tokendance bench reuse` at fixed lengths: N
agents, each with `--history` private tokens, a Master of the N outputs of `--output`
tokens each, ceil(r * N * output) patches per agent and `--generated` tokens per agent.
Fused restore moves the Master once and each agent's history + patches + generated;
dense restore moves each agent's history + every shared token + generated. No model:
a KVCache of the shape's layers, KV heads and head_dim, filled with random K/V, parked
from one random block layout and restored into another. Time per restore: CUDA events
after a warm-up (perf_counter on CPU), median of `--repeats`.

    tokendance bench restore --agents 10,20 --ratio 0.15,0.05
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from types import SimpleNamespace

import torch

from tokendance.backend.arena import PAGE_BYTES
from tokendance.backend.config import DTYPES
from tokendance.backend.device import pick_device
from tokendance.backend.model import KVCache
from tokendance.backend.offload import HostTier
from tokendance.bench.options import counts, natural, positive, shares
from tokendance.kernels.restore import gather_slots


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-7b", help="a name from bench/shapes.py")
    p.add_argument("--layers", type=positive, help="override the shape's layers")
    p.add_argument("--kv-heads", type=positive, help="override the shape's KV heads")
    p.add_argument("--head-dim", type=positive, help="override the shape's head_dim")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--block-size", type=positive, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--agents", type=counts, default="10,20", help="N, comma list")
    p.add_argument("--history", type=natural, default=512)
    p.add_argument("--output", type=natural, default=150)
    p.add_argument("--ratio", type=shares, default="0.15,0.05", help="recompute ratios, comma list")
    p.add_argument("--generated", type=natural, default=128)
    p.add_argument("--repeats", type=positive, default=5)
    p.add_argument("--json", help="write the rows here")


def dims(args: argparse.Namespace) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the shape, with overrides."""
    from tokendance.bench.shapes import SHAPES

    if args.shape not in SHAPES:
        raise SystemExit(f"unknown shape {args.shape!r}; choose one of {', '.join(SHAPES)}")
    s = SHAPES[args.shape]
    return (args.layers or s["num_hidden_layers"], args.kv_heads or s["num_key_value_heads"],
            args.head_dim or s["hidden_size"] // s["num_attention_heads"])


def sizes(n: int, r: float, args: argparse.Namespace) -> tuple[int, int, int]:
    """Tokens of (the Master, one agent's private part, one agent's dense cache)."""
    master = n * args.output
    private = args.history + math.ceil(r * n * args.output) + args.generated
    return master, private, args.history + master + args.generated


class Layout:
    """Flat slots of runs of tokens, each in its own shuffled blocks (last one partial)."""

    def __init__(self, blocks: int, bs: int, seed: int):
        self.bs = bs
        self.free = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self, n: int) -> torch.Tensor:
        ids = torch.tensor([self.free.pop() for _ in range(-(-n // self.bs))], dtype=torch.long)
        return (ids[:, None] * self.bs + torch.arange(self.bs)).flatten()[:n]


def plans(cache: KVCache, n: int, m: int, p: int, d: int, seed: int) -> dict:
    """Source and destination slots of both kinds (a fresh block layout for each)."""
    def one(s: int) -> dict:
        fused, dense = (Layout(cache.num_blocks, cache.block_size, s + i) for i in (0, 1))
        return {"fused": (fused.take(m), [fused.take(p) for _ in range(n)]),
                "dense": (None, [dense.take(d) for _ in range(n)])}
    return {"src": one(seed), "dst": one(seed + 2)}


def restore_once(tier: HostTier, kind: str, plan: dict, device: torch.device,
                 check: bool = False) -> tuple[float, int]:
    """Park the group (untimed), then time its restore: (ms, host bytes moved)."""
    (msrc, srcs), (mdst, dsts) = plan["src"][kind], plan["dst"][kind]
    cuda = device.type == "cuda"
    to = (lambda t: t.to(device)) if cuda else (lambda t: t)
    if msrc is not None:
        tier.put_master(0, to(msrc))
    for i, s in enumerate(srcs):
        tier.park(f"a{i}", to(s), [0] if msrc is not None else [])
    if msrc is not None:
        tier.release_master(0)  # the agents hold it now: freed with the last one restored
    allsrc = torch.cat(([msrc] if msrc is not None else []) + srcs)
    moved = allsrc.numel() * tier.token_bytes()  # what crosses the link (the tier holds whole pages)
    want = gather_slots(tier.cache.kv, to(allsrc)) if check else None
    items = [(f"a{i}", to(s)) for i, s in enumerate(dsts)]
    masters = {0: to(mdst)} if msrc is not None else {}
    if cuda:
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        tier.restore(items, masters)
        t1.record()
        torch.cuda.synchronize()
        ms = t0.elapsed_time(t1)
    else:
        t = time.perf_counter()
        tier.restore(items, masters)
        ms = (time.perf_counter() - t) * 1e3
    assert tier.bytes == 0 and not tier.masters, "the tier must be empty after the restore"
    if check:
        alldst = torch.cat(([mdst] if msrc is not None else []) + dsts)
        if not torch.equal(gather_slots(tier.cache.kv, to(alldst)), want):
            raise SystemExit(f"{kind} restore is not bit-exact")
    return ms, moved


def run(n: int, ratios: list[float], args: argparse.Namespace, shape: tuple[int, int, int]) -> list[dict]:
    dev = torch.device(args.device)
    layers, hkv, hd = shape
    bs = args.block_size

    def blocks(r: float) -> int:  # one layout of either kind must fit
        m, p, d = sizes(n, r, args)
        return max(n * -(-d // bs), -(-m // bs) + n * -(-p // bs))

    cfg = SimpleNamespace(num_layers=layers, num_kv_heads=hkv, head_dim=hd)
    cache = KVCache(cfg, max(map(blocks, ratios)), bs, DTYPES[args.dtype], dev)
    cache.kv.normal_()
    # Room for any one layout, each entry's last page partly used: no eviction, what is
    # measured is the restore (the tier pins its budget when made).
    tier = HostTier(cache, cache.kv.numel() * cache.kv.element_size() + (n + 1) * PAGE_BYTES)
    dense_ms, dense_bytes = [], 0
    rows = []
    for j, r in enumerate(ratios):
        m, p, d = sizes(n, r, args)
        plan = plans(cache, n, m, p, d, seed=10 * n + j)
        fused_ms = []
        for k in range(args.repeats + 1):  # the first is the warm-up, checked bit-exact
            ms, fused_bytes = restore_once(tier, "fused", plan, dev, check=k == 0)
            fused_ms.append(ms)
            if j == 0:
                ms, dense_bytes = restore_once(tier, "dense", plan, dev, check=k == 0)
                dense_ms.append(ms)
        f, dn = statistics.median(fused_ms[1:]), statistics.median(dense_ms[1:])
        rows.append(dict(agents=n, ratio=r, master=m, private=p, dense=d, bytes_fused=fused_bytes,
                         bytes_dense=dense_bytes, ms_fused=f, ms_dense=dn, speedup=dn / f,
                         gbps_fused=fused_bytes / f / 1e6, gbps_dense=dense_bytes / dn / 1e6))
    del tier, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(args: argparse.Namespace) -> int:
    shape = dims(args)
    args.device = str(pick_device(args.device))  # a bad one is a one-line error, not torch's traceback
    ratios, agents = args.ratio, args.agents
    tok = shape[0] * 2 * shape[1] * shape[2] * DTYPES[args.dtype].itemsize
    print(f"restore from the host tier on {args.device}: {args.shape} K/V ({shape[0]} layers, "
          f"{shape[1]} KV heads, head_dim {shape[2]}, {args.dtype}, {tok} bytes/token), block "
          f"{args.block_size}; history {args.history}, outputs {args.output}, generated "
          f"{args.generated}; median of {args.repeats}")
    print("| N | r | MB fused | MB dense | ms fused | ms dense | speed-up | GB/s fused / dense |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for n in agents:
        for row in run(n, ratios, args, shape):
            rows.append(row)
            print(f"| {n} | {row['ratio']:.2f} | {row['bytes_fused'] / 1e6:.1f} | "
                  f"{row['bytes_dense'] / 1e6:.1f} | {row['ms_fused']:.2f} | {row['ms_dense']:.2f} | "
                  f"{row['speedup']:.2f}x | {row['gbps_fused']:.1f} / {row['gbps_dense']:.1f} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=args.shape, dims=shape, dtype=args.dtype, token_bytes=tok,
                           device=args.device, rows=rows), f, indent=1)
    return 0
