"""`tokendance bench reuse`: one All-Gather round prefilled in every reuse mode (with
`--fanout`, partial broadcasts too: each agent reads K of the N outputs; bench/allgather.py).

For each mode, in one run on one engine: the round's prefill time (every agent's
prompt up to its first token, or with --decode N up to its N-th; median of repeats,
the modes taking turns, caches cleared before each round), the tokens computed
(token-layers / layers), the compute limit N·P + S + r·N·S (r·K·S with a fan-out K),
and what the round's KV holds in the live pool:
- round footprint: the N agents' dense caches / everything held for the round (each
  request's private KV at its end, plus the Master: the shared segments' bases the
  segment cache holds at its end, none where only readers quote a segment);
- Mirror compression: the dense KV of the shared segments / what the requests hold
  privately for them (a Mirror its patches; a reader, with reader bases, what its K/V
  do not share with the Master: backend/diff.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tokendance.backend.api import ANCHORED, KV_DTYPES, MODES, REUSE_DEFAULTS, SamplingParams, Usage
from tokendance.backend.device import sync
from tokendance.backend.engine import Engine
from tokendance.bench.allgather import Round, make_round
from tokendance.bench.options import counts, names, natural, nonnegative, positive, share
from tokendance.bench.shapes import round_engine
from tokendance.bench.step_split import profiled, traced

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass(slots=True)
class Played:
    answers: list[list[int]]  # per agent
    seconds: float
    computed: float  # tokens computed: token-layers / layers
    usage: list[Usage]  # per agent
    predicted: int  # kvcomm / kvcmas: requests that read predicted offsets (the rest prefilled exactly)
    anchor_bytes: int  # kvcomm / kvcmas: what the anchors hold at the round's end
    bases: int  # tokens the segment cache holds at the round's end (the Master)


def play(eng: Engine, rnd: Round, mode: str, sampling: SamplingParams = ONE, tag: str = "r",
         agents: bool = False, serial: bool = False) -> Played:
    """One round to its end on the engine as it is (callers reset caches for a cold one);
    with `agents`, request i names agent a<i>, as a session's request does (a reusing
    mode parks its KV, backend/idle.py; kvcomm's anchors are its own; kvcmas publishes
    its output); with `serial`, each request is added only once the one before it has
    finished."""
    sync(eng.device)
    anchored = eng.collector.anchored.get(mode)
    work0, predicted0 = eng.runner.work, anchored.predicted if anchored else 0
    ids = [f"{tag}{i}" for i in range(rnd.agents)]
    answers: dict[str, list[int]] = {rid: [] for rid in ids}
    usage: dict[str, Usage] = {}

    def drain() -> None:
        while eng.has_work():
            for rid, d in eng.step():
                answers[rid] += d.token_ids
                if d.usage is not None:
                    usage[rid] = d.usage

    t0 = time.perf_counter()
    for i, (rid, p, sp) in enumerate(zip(ids, rnd.prompts, rnd.shared)):
        eng.add(rid, p, sampling, mode=mode, shared=sp, publish=agents, agent=f"a{i}" if agents else None)
        if serial:
            drain()
    drain()
    sync(eng.device)
    dt = time.perf_counter() - t0
    return Played([answers[r] for r in ids], dt, (eng.runner.work - work0) / len(eng.model.layers),
                  [usage[r] for r in ids], anchored.predicted - predicted0 if anchored else 0,
                  eng.collector.anchors.nbytes, sum(e.ntokens for e in eng.segments.entries.values()))


def cold(eng: Engine, rnd: Round, mode: str, sampling: SamplingParams = ONE, serial: bool = False,
         readers: bool = False, rehearsal: Round | None = None) -> Played:
    """The round from cold caches (prefill, and decode past one token); with `readers`,
    its shared segments' bases come from readers (`--bases reader`), else as configured.
    kvcomm (kvcmas) keeps the anchors an exact round of `rehearsal` measured (untimed)."""
    eng.reset_caches()
    if mode in ANCHORED and rehearsal is not None:
        play(eng, rehearsal, mode, tag="x", agents=True)
        eng.reset_caches(anchors=False)
    own = eng.collector.cfg.readers
    eng.collector.cfg.readers = readers or own
    try:
        return play(eng, rnd, mode, sampling, serial=serial, agents=mode in ANCHORED)
    finally:
        eng.collector.cfg.readers = own


def footprint(eng: Engine, played: Played, mode: str) -> tuple[float, float | None]:
    """(round footprint, Mirror compression) of a finished round from cold caches; see the
    module doc."""
    usage = played.usage
    dense = sum(u.kv_dense_bytes for u in usage)
    master = played.bases * eng.kv_bytes_per_token if mode in ("pic", "collective") else 0
    held = sum(u.kv_held_bytes for u in usage) + master
    shared = sum(u.shared_tokens for u in usage)
    # What each holds privately, less its tokens outside the shared segments.
    private = sum(u.kv_held_bytes // eng.kv_bytes_per_token - (u.prompt_tokens - u.shared_tokens)
                  - u.completion_tokens for u in usage)
    return dense / held, (shared / private if mode in ("pic", "collective") and private else None)


def bench(eng: Engine, agents: list[int], history: int, output: int, repeats: int, modes: list[str],
          seed: int = 0, decode: int = 1, serial: list[str] = (), readers: list[str] = (),
          fanouts: list[int] = (0,)) -> list[dict]:
    """Rows of the table, one per mode, N and fan-out (0: All-Gather; bench/allgather.py,
    each at most N); each mode in `serial` also gets a row of its
    own served one request at a time ("serial pic": what per-request reuse costs when
    every agent's request is handled alone, the paper's baseline for collective reuse),
    and each in `readers` one with reader bases ("reader collective")."""
    rows = []
    sampling = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    runs = ({mode: (mode, False, False) for mode in modes}
            | {f"serial {mode}": (mode, True, False) for mode in serial}
            | {f"reader {mode}": (mode, False, True) for mode in readers})
    for n, k in [(n, k) for n in agents for k in fanouts]:
        rnd = make_round(n, history, output, vocab, seed=seed + n, fanout=k)
        earlier = make_round(n, history, output, vocab, seed=seed + n + 1, fanout=k)  # kvcomm's / kvcmas's anchors
        # Warm-up: every mode once, with a few decode steps (Triton compiles a kernel
        # variant the first time a batch shape needs it).
        for mode, one, rd in runs.values():
            cold(eng, rnd, mode, SamplingParams(max_tokens=min(decode, 4), temperature=0,
                                                ignore_eos=True), one, rd, earlier)
        # The modes take turns, repeat by repeat: a slow spell of the machine then falls
        # on every mode alike instead of on one mode's repeats.
        times: dict[str, list[float]] = {name: [] for name in runs}
        last: dict[str, Played] = {}
        for _ in range(repeats):
            for name, (mode, one, rd) in runs.items():
                last[name] = cold(eng, rnd, mode, sampling, one, rd, earlier)
                times[name].append(last[name].seconds)
        res = {name: (statistics.median(times[name]), last[name].computed,
                      *footprint(eng, last[name], mode)) for name, (mode, *_) in runs.items()}
        limit = rnd.limit(eng.collector.cfg.ratio)
        vs = lambda name, t: res[name][0] / t if name in res else None  # noqa: E731
        for name in runs:
            t, w, foot, comp = res[name]
            rows.append(dict(agents=n, fanout=k or n, mode=name, max_tokens=decode, ms=1000 * t, computed=w,
                             limit=limit,
                             footprint=foot, compression=comp, ratio=eng.collector.cfg.ratio,
                             prompt_tokens=rnd.prompt_tokens, shared=rnd.shared_tokens,
                             vs_pic=vs("pic", t), vs_serial_pic=vs("serial pic", t), vs_full=vs("full", t),
                             predicted=last[name].predicted if runs[name][0] in ANCHORED else None,
                             anchor_bytes=last[name].anchor_bytes if runs[name][0] in ANCHORED else None))
    return rows


def table(rows: list[dict]) -> str:
    d = rows[0].get("max_tokens", 1) if rows else 1
    what = "round prefill ms" if d == 1 else f"round ms ({d} tokens)"
    head = (f"| N | mode | {what} | tokens computed | limit | computed/limit | speedup vs pic "
            f"| vs serial pic | vs full | round footprint | Mirror compression |")
    partial = any(r.get("fanout", r["agents"]) != r["agents"] for r in rows)
    if partial:  # the outputs each agent reads
        head = head.replace("| N |", "| N | K |", 1)
    out = [head, "|" + "---|" * (11 + partial)]
    for r in rows:
        f = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
        mode = r["mode"]
        if r.get("predicted") is not None:
            mode += f" ({r['predicted']}/{r['agents']} predicted, anchors {r['anchor_bytes'] / 2**20:,.0f} MiB)"
        k = f" {r['fanout']} |" if partial else ""
        out.append(f"| {r['agents']} |{k} {mode} | {r['ms']:.0f} | {r['computed']:.0f} | {r['limit']:.0f} | "
                   f"{r['computed'] / r['limit']:.2f} | {f(r['vs_pic'])} | {f(r['vs_serial_pic'])} | "
                   f"{f(r['vs_full'])} | {f(r['footprint'])} | {f(r['compression'])} |")
    return "\n".join(out)


def profiles(eng: Engine, rows: list[dict], n: int, history: int, output: int, modes: list[str],
             decode: int, top: int, trace: str | None = None, fanout: int = 0) -> str:
    """Per mode, one more cold round of n agents (each reading `fanout` outputs) under the
    profiler: how much of the timed round (its median in rows) keeps the device busy, and
    the top ops. With `trace` (a folder), one more per mode with Python stacks: its chrome
    trace there."""
    rnd = make_round(n, history, output, min(eng.mcfg.vocab_size, len(eng.tokenizer)), seed=n, fanout=fanout)
    sampling = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    out = [f"\nProfiled: N = {n}, one cold round per mode", "| mode | round ms | device busy ms | busy share |",
           "|---|---|---|---|"]
    tables = []
    for mode in modes:
        ms = next(r["ms"] for r in rows if r["agents"] == n and r["fanout"] == (fanout or n) and r["mode"] == mode)
        eng.reset_caches()
        busy, ops = profiled(eng, lambda: play(eng, rnd, mode, sampling), top)
        out.append(f"| {mode} | {ms:.0f} | {busy:.0f} | {busy / ms:.2f} |")
        if trace:
            eng.reset_caches()
            traced(eng, lambda: play(eng, rnd, mode, sampling), str(Path(trace) / f"{mode}-n{n}.json.gz"))
        tables.append(f"\n{mode}:\n{ops}")
    return "\n".join(out + tables)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (qwen2.5-7b)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--agents", type=counts, default="2,4,8,16", help="N, comma list")
    p.add_argument("--history", type=natural, default=512)
    p.add_argument("--output", type=natural, default=150)
    p.add_argument("--fanout", type=counts, default=None, metavar="K[,K...]",
                   help="outputs each agent reads, comma list, each at most every N (default: all "
                        "of them, All-Gather; 1: a ring of chains)")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--modes", type=names(MODES, least=1), default=",".join(MODES))
    p.add_argument("--serial", type=names(MODES), default="",
                   help="modes also timed with each agent's request served alone, one after another "
                        "(a row 'serial pic' for pic)")
    p.add_argument("--readers", type=names(("pic", "collective")), default="",
                   help="reuse modes also timed with reader bases (a row 'reader collective' for "
                        "collective; docs/fidelity.md)")
    p.add_argument("--kv-tokens", type=natural, default=0)
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto", help="the pool's: fp8 holds 8-bit K/V")
    p.add_argument("--anchor-gib", type=nonnegative, default=16.0,
                   help="kvcomm's and kvcmas's anchors: every agent's every segment keeps one (N x N of them)")
    p.add_argument("--json", default=None, help="write rows here")
    p.add_argument("--dump-prompts", default=None, help="write each round's prompts (for vLLM)")
    p.add_argument("--decode", type=positive, default=1, help="max_tokens per agent (1: prefill to the first token)")
    p.add_argument("--ratio", type=share, default=REUSE_DEFAULTS["recompute_ratio"],
                   help="share of reused tokens recomputed")
    p.add_argument("--floor", type=nonnegative, default=REUSE_DEFAULTS["recompute_floor"],
                   help="recompute only reused tokens whose check-layer deviation exceeds this")
    p.add_argument("--profile", type=natural, default=0, metavar="TOP",
                   help="then profile one cold round per mode at the first N: device busy time "
                        "against the timed round, and the TOP ops")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: also a chrome trace per mode with Python stacks in DIR "
                        "(tokendance bench gaps reads them)")


def main(args: argparse.Namespace) -> int:
    if args.trace and not args.profile:
        raise ValueError("--trace needs --profile TOP (it traces the profiled rounds)")
    agents = args.agents
    fanouts = args.fanout or [0]
    if max(fanouts) > min(agents):
        raise ValueError(f"--fanout {max(fanouts)} exceeds --agents {min(agents)}: "
                         "an agent reads at most every output")
    if args.dump_prompts and len(fanouts) > 1:
        raise ValueError("--dump-prompts writes one round per N: give one --fanout")
    need = max(agents) * (args.history * 2 + max(agents) * args.output * 2 + args.decode) + 4096
    eng, vocab = round_engine(args.model, args.dtype, args.kv_tokens or need, args.random_weights,
                              recompute_ratio=args.ratio, recompute_floor=args.floor,
                              anchor_bytes=int(args.anchor_gib * 2**30), kv_cache_dtype=args.kv_cache_dtype)
    modes = args.modes
    if args.dump_prompts:
        rounds = {n: make_round(n, args.history, args.output, vocab, seed=n, fanout=fanouts[0]).prompts
                  for n in agents}
        Path(args.dump_prompts).write_text(json.dumps(rounds))
    rows = bench(eng, agents, args.history, args.output, args.repeats, modes, decode=args.decode,
                 serial=args.serial, readers=args.readers, fanouts=fanouts)
    print(f"model {eng.name} ({eng.mcfg.num_layers} layers) on {eng.device}, {eng.dtype}, KV pool "
          f"{str(eng.cache.kv.dtype).removeprefix('torch.')}; "
          f"histories ~{args.history}, outputs ~{args.output}, max_tokens {args.decode}, "
          f"ratio {eng.collector.cfg.ratio}, floor {eng.collector.cfg.floor}")
    print(table(rows))
    if args.profile:
        print(profiles(eng, rows, agents[0], args.history, args.output, modes, args.decode, args.profile,
                       args.trace, fanouts[0]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
