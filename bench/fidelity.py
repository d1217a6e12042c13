"""`tokendance bench fidelity`: how far pic / collective reuse sits from exact prefill.

On a debate (every agent sees every other agent's last answer), against `full`:
1. per-layer relative deviation of the reused tokens' K and V from the exact ones;
2. teacher-forced greedy agreement: feed full's own continuation after the reused
   prompt and count how often the argmax still picks full's next token;
3. closed loop: N agents, R rounds, each mode feeding on its own answers; the round
   where each agent's answer first differs from full's.
Prompts (the bench's debates or `simulate debate`'s: bench/debates.py) go through the
proxy's segmentation and the engine backend, as served.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch

from tokendance.backend.api import ANCHORED, BASES, KV_DTYPES, MODES, REUSE_DEFAULTS, REUSING, SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.keys import segment_key
from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.runner import step_meta
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.service import EngineBackend
from tokendance.bench.debates import PROMPTS, Board, debate, questions
from tokendance.bench.options import counts, names, natural, nonnegative, positive, share
from tokendance.examples.scenario import Scenario


def agents(prepared) -> list[str]:
    """Debater i of a round is agent d<i> (kvcomm's anchors are per agent)."""
    return [f"d{i}" for i in range(len(prepared))]


def run(eng: Engine, prepared, mode: str, producer: bool = False) -> list[str]:
    """One round's answers. Without `producer` every reusable KV is forgotten first, so
    each shared segment's base is prefilled standalone; with it (`--bases producer`), each
    answer's KV is kept as its base for the next round (producer chaining; kvcmas's
    always). kvcomm's and kvcmas's anchors stay: they are what it learns from one round
    for the next."""
    producer = producer or mode == "kvcmas"
    if not producer:
        eng.reset_caches(anchors=False)
    toks = [p.state for p in prepared]
    res = eng.generate([t.ids for t in toks], prepared[0].request.sampling, mode=mode,
                       shared=[t.shared for t in toks], publish=producer, agents=agents(prepared))
    return [text for _, text, _ in res]


def layer_kv(eng: Engine, seq) -> torch.Tensor:
    """[layers, 2, T, H, D]: the K/V each layer reads for the sequence's prompt (a
    Mirror's from its own slots or the Master, by layer)."""
    b, rows = eng.cache.block_size, torch.arange(len(seq.prompt))
    out = []
    for li, (k, v) in enumerate(zip(eng.cache.k, eng.cache.v)):
        slots = seq.read_slots(rows, EARLY if li < eng.runner.late_from else LATE, b)
        out.append(torch.stack([k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]]))
    return torch.stack(out).float()


def continued(eng: Engine, s, cont: list[int]) -> torch.Tensor:
    """The logits [len(cont) - 1, vocab] after each token of `cont` but its last, fed after
    s's prefilled prompt in one forward that reads the prompt's K/V from the pool."""
    s.out = list(cont[:-1])
    assert eng.blocks.reserve(s, len(s))
    ids, meta, _ = step_meta([Scheduled(s, len(s.prompt), len(cont) - 1)], eng.cache.block_size,
                             eng.device, eng.cache.trash, eng.runner.late_from)
    return eng.model(ids, meta, eng.cache)


@torch.inference_mode()
def teacher_forced(eng: Engine, prepared, mode: str, cont: list[list[int]], producer: bool = False
                   ) -> tuple[list[torch.Tensor], list[list[bool]], tuple[int, int], torch.Tensor, list[bool]]:
    """The prompts' KV per layer after this mode's prefill, per token of full's
    continuations whether this mode's argmax picks it (the first from the prefill's
    logits, each later one fed the ones before), (shared tokens, of them held privately:
    patches, or what a reader does not share) over the prompts, the prefill's next-token
    log-probabilities [N, vocab], and which prompts read reused KV (Mirrors, not
    readers, which reader bases prefill in full; kvcomm's predicted prompts). With
    `producer`, the segment cache keeps its producers' bases."""
    if not producer:
        eng.reset_caches(anchors=False)
    seqs = []
    for i, (p, who) in enumerate(zip(prepared, agents(prepared))):
        tok = p.state
        eng.add(f"tf-{mode}-{i}", tok.ids, SamplingParams(max_tokens=1, temperature=0), mode=mode,
                shared=tok.shared, agent=who)
        seqs.append(eng.seqs[f"tf-{mode}-{i}"])
    if mode in REUSING:
        ready, first = eng.collector.prefill(seqs, mode)
        assert ready == seqs
    else:
        for s in seqs:
            assert eng.blocks.reserve(s, len(s.prompt))
        first, _ = eng.runner.run([Scheduled(s, 0, len(s.prompt)) for s in seqs])
    kvs = [layer_kv(eng, s) for s in seqs]
    # Held privately for the shared segments: all a request holds but its other tokens.
    counts = (sum(s.shared_tokens for s in seqs), sum(s.held - (len(s.prompt) - s.shared_tokens) for s in seqs))
    mirrors = [(s.mirror is not None and not s.reader) or (s.mode in ANCHORED and s.cached > 0) for s in seqs]
    hits = []
    for s, c, f in zip(seqs, cont, first.argmax(-1).tolist()):
        pred = [f] + continued(eng, s, c).argmax(-1).tolist()
        hits.append([a == b for a, b in zip(pred, c)])
    for s in seqs:
        eng.abort(s.id)
    return kvs, hits, counts, first.float().log_softmax(-1), mirrors


def open_loop(eng: Engine, be: EngineBackend, modes: list[str], n0: int, count: int,
              greedy: SamplingParams, producer: bool = False, prompts: str = "bench") -> str:
    """Sections 1 and 2 on round-2 prompts of `count` debates of n0 agents (with
    `producer`, their bases are full's round-1 answers' own KV)."""
    out: list[str] = []
    # 1 + 2: one round-2 prompt set per question, built from full's round-1 answers.
    devs = {m: [] for m in modes[1:]}
    agree = {m: [] for m in modes}
    kl = {m: [] for m in modes}  # per agent: KL(full || mode) of the first token's distribution
    counts = {m: [0, 0] for m in modes[1:]}  # shared tokens, held privately
    read = {m: 0 for m in modes[1:]}  # prompts that read reused KV
    eng.reset_caches()
    for m in (m for m in ANCHORED if m in modes):  # its anchors: another question's round 2, prefilled exactly
        b = Board(debate(prompts, n0, count))
        b.observe(run(eng, b.requests(be, "full", greedy), "full", producer))
        run(eng, b.requests(be, m, greedy), m, producer)
    count = min(count, len(questions(prompts)))
    for k in range(count):
        eng.reset_caches(anchors=False)
        b = Board(debate(prompts, n0, k))
        b.observe(run(eng, b.requests(be, "full", greedy), "full", producer))
        prepared = {m: b.requests(be, m, greedy) for m in modes}
        full_out = eng.generate([p.state.ids for p in prepared["full"]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        cont = [toks for toks, _, _ in full_out]
        exact, a, _, ref, _ = teacher_forced(eng, prepared["full"], "full", cont, producer)
        agree["full"] += a
        kl["full"] += [0.0] * len(a)
        for m in modes[1:]:
            kvs, a, (shared, held), lp, reads = teacher_forced(eng, prepared[m], m, cont, producer)
            agree[m] += [h for h, r in zip(a, reads) if r]
            kl[m] += [d for d, r in zip((ref.exp() * (ref - lp)).sum(-1).tolist(), reads) if r]
            counts[m][0] += shared
            counts[m][1] += held
            read[m] += sum(reads)
            for kv, ex, p, r in zip(kvs, exact, prepared[m], reads):
                if not r:
                    continue
                mask = torch.zeros(kv.shape[2], dtype=torch.bool)
                for lo, hi in p.state.shared:
                    mask[lo:hi] = True
                diff = (kv[:, 1, mask] - ex[:, 1, mask]).flatten(2).norm(dim=-1)
                devs[m].append((diff / ex[:, 1, mask].flatten(2).norm(dim=-1).clamp_min(1e-9)).mean(-1))
    layers = eng.mcfg.num_layers
    picks = sorted(l for l in {1, 2, 5, 10, layers // 2, layers - 1} if l < layers)
    out.append(f"\nPrompts that read reused KV, of {n0 * count}: "
               + ", ".join(f"{m} {read[m]}" for m in modes[1:]) + " (kvcomm's others: a segment's place had no anchor)")
    out.append("\nPer-layer mean relative V deviation of reused tokens from exact (round-2 prompts; here")
    out.append("and below, over the prompts that read reused KV: with reader bases, not the readers):")
    out.append("| mode | " + " | ".join(f"layer {l}" for l in picks) + " |\n|---|" + "---|" * len(picks))
    for m in (m for m in modes[1:] if devs[m]):
        d = torch.stack(devs[m]).mean(0)
        out.append(f"| {m} | " + " | ".join(f"{d[l]:.3f}" for l in picks) + " |")
    out.append("\nTeacher-forced greedy agreement with full (24 tokens per agent; the first token")
    out.append("alone), the first token's KL(full || mode), mean and largest over the agents, and, over")
    out.append("every prompt, the shared tokens held privately (patches, or what a reader does not share;")
    out.append("Mirror compression = shared / held privately):")
    out.append("| mode | agreement | first token | KL mean | KL max | shared tokens | held privately | compression |\n"
               "|---|---|---|---|---|---|---|---|")
    for m in (m for m in modes if agree[m]):
        shared, rec = counts.get(m, (0, 0))
        comp = f"{shared / rec:.2f}x" if rec else "-"
        every = statistics.mean(x for h in agree[m] for x in h)
        first = statistics.mean(h[0] for h in agree[m])
        out.append(f"| {m} | {every:.3f} | {first:.3f} | {statistics.mean(kl[m]):.4f} | {max(kl[m]):.4f} "
                   f"| {shared or '-'} | {rec if m != 'full' else '-'} | {comp} |")
    return "\n".join(out)


def tally(eng: Engine, prepared, bases: Counter, absent: str) -> None:
    """Count the round's shared segments by the source of their base KV in the segment
    cache, `absent` where it holds none. Before a round with producer bases: a producer's
    output kept from the last round, else a standalone prefill to come; after any other
    round: the base the round made (`standalone` or `reader`)."""
    for p in prepared:
        for lo, hi in p.state.shared:
            e = eng.segments.get(segment_key(p.request.tenant, p.state.ids[lo:hi]))
            bases[e.source if e is not None else absent] += 1


def closed_loop(eng: Engine, be: EngineBackend, make: Callable[[], Scenario], modes: list[str], rounds: int,
                sampling: SamplingParams, producer: bool = False, bases: Counter | None = None
                ) -> dict[str, list[int | None]]:
    """Each mode debates (a fresh `make()`) on its own answers; per mode other than full
    and per agent, the first round (from 1) whose answer differs from full's, None if
    none does. `bases` counts the shared segments of the reusing modes by the source of
    their base KV."""
    bases = Counter() if bases is None else bases
    hist: dict[str, list[list[str]]] = {}
    for m in modes:
        board = Board(make())
        hist[m] = []
        eng.reset_caches()
        for _ in range(rounds):
            prepared = board.requests(be, m, sampling)
            if m != "full" and producer:
                tally(eng, prepared, bases, "standalone")
            answers = run(eng, prepared, m, producer)
            if m != "full" and not producer:
                tally(eng, prepared, bases, "computed in place")  # as private text, or by readers alone
            board.observe(answers)
            hist[m].append(answers)
    n = len(hist["full"][0])
    return {m: [next((r + 1 for r in range(rounds) if hist[m][r][i] != hist["full"][r][i]), None)
                for i in range(n)] for m in modes[1:]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--agents", type=counts, default="4,8", help="N, comma list")
    p.add_argument("--rounds", type=positive, default=4)
    p.add_argument("--max-tokens", type=positive, default=48)
    p.add_argument("--questions", type=natural, default=2, help="open-loop debates (one per question)")
    p.add_argument("--prompts", choices=PROMPTS, default="bench",
                   help="the bench's opinion debates, or `tokendance simulate debate`'s (bench/debates.py)")
    p.add_argument("--ratio", type=share, default=REUSE_DEFAULTS["recompute_ratio"])
    p.add_argument("--modes", type=names(tuple(m for m in MODES if m != "full"), least=1),
                   default="pic,collective", help="reuse modes compared with full")
    p.add_argument("--loops", type=positive, default=1, help="closed-loop debates per N (each on its own question)")
    p.add_argument("--floor", type=nonnegative, default=REUSE_DEFAULTS["recompute_floor"],
                   help="recompute only reused tokens whose check-layer deviation exceeds this")
    p.add_argument("--check-layer", type=positive, default=1,
                   help="where deviating tokens are selected (every reused token is recomputed before it)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                   help="the pool's, for every mode (full included): fp8 compares the modes in an 8-bit pool")
    p.add_argument("--bases", choices=BASES, default=REUSE_DEFAULTS["bases"],
                   help="shared segments' base KV prefilled standalone, or the KV their producer "
                        "computed (the open loop's producers are full's round-1 answers)")


def main(args: argparse.Namespace) -> int:
    eng = Engine(EngineConfig(model=args.model, dtype="float32", kv_tokens=65536, recompute_ratio=args.ratio,
                              recompute_floor=args.floor, bases=args.bases, check_layer=args.check_layer,
                              kv_cache_dtype=args.kv_cache_dtype))
    be = EngineBackend(eng)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    modes = ["full", *args.modes]
    producer = args.bases == "producer"
    print(f"model {eng.name}, float32, KV pool {args.kv_cache_dtype}, recompute ratio {args.ratio}, floor {args.floor}, "
          f"check layer {eng.collector.cfg.check_layer}, {args.prompts} prompts")
    if args.questions:
        print(open_loop(eng, be, modes, args.agents[0], args.questions, greedy, producer, args.prompts))
    # 3: closed loop.
    print(f"\nClosed-loop debate, {args.rounds} rounds, greedy, {args.max_tokens} tokens per answer, "
          f"{args.loops} question(s) per N, {args.bases} bases:")
    print("| N | mode | debates with no divergence | agents never diverged | "
          "mean first divergent round (diverged agents) |\n|---|---|---|---|---|")
    bases: Counter = Counter()
    for n in args.agents:
        firsts: dict[str, list[int | None]] = {m: [] for m in modes[1:]}
        clean = {m: 0 for m in modes[1:]}
        for k in range(args.loops):
            make = partial(debate, args.prompts, n, n + k)
            for m, f in closed_loop(eng, be, make, modes, args.rounds, greedy, producer, bases).items():
                firsts[m] += f
                clean[m] += all(r is None for r in f)
        for m in modes[1:]:
            div = [r for r in firsts[m] if r is not None]
            mean = f"{statistics.mean(div):.2f}" if div else "-"
            print(f"| {n} | {m} | {clean[m]}/{args.loops} | {len(firsts[m]) - len(div)}/{len(firsts[m])} | {mean} |")
    print("Shared segments by base: " + ", ".join(f"{n} {src}" for src, n in sorted(bases.items())) + ".")
    for m in (m for m in ANCHORED if m in modes):
        a = eng.collector.anchored[m]
        print(f"{m}: {a.predicted} requests read predicted offsets, {a.measured} with reused segments were "
              "prefilled exactly (a segment's place had no anchor yet; their offsets became anchors).")
    return 0
