"""CUDA checks that CPU tests cannot make: CUDA-graph decode equals eager decode, decode
with lookahead equals decode without, the engine's greedy tokens equal HF transformers'
on the same random weights (bf16 and fp32), Mirrors (the Triton kernels through
slot-position tables, and the Master read collectively in decode) give what the dense
paths give, pools of 8- and 32-slot blocks serve what 16-slot ones do, and with producer
bases requests ended by length publish exact K/V; then
the kernels against their references (bench/check_kernels.py) and the serving checks
(bench/check_serving.py). Run on the GPU machine:
python -m tokendance.bench.check_cuda [act | blocks | memory | mirrors]"""

from __future__ import annotations

import copy
import gc
import sys

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.pool import flat_slots
from tokendance.bench.check_kernels import act, deviation_parts_vs_reference, diff_vs_reference
from tokendance.bench.check_serving import memory_share, structured_after
from tokendance.bench.engine import hf_model, rand_prompts
from tokendance.bench.shapes import SHAPES
from tokendance.bench.small import REUSE_ALL, seeded, small_folder


def vocab(shape: str) -> int:
    """Token ids to draw below: the shape's and the tokenizer's vocabulary both."""
    return min(49152, SHAPES[shape]["vocab_size"])


def graphs_vs_eager(mirrors: bool = False, n: int = 11, segments: int = 0, shape: str = "qwen2.5-7b",
                    **cfg) -> float:
    """Relative error of a replayed decode step against the same step run eagerly: n
    plain sequences, or n Mirrors of one round (a graph of 16 rows for 11, of 24 for 20;
    52 read more segments than CHUNK_CAP: a wide graph, captured at that step); with
    `segments`, n Mirrors that each read that many short outputs; `cfg`, the engine's
    other fields (8-bit weights)."""
    from tokendance.backend.graphs import CHUNK_CAP, WIDE_CAPS
    from tokendance.bench.allgather import make_round

    eng = Engine(EngineConfig(model=str(small_folder(shape=shape)), dtype="bfloat16", random_weights=True,
                              kv_tokens=16 * 4096 if n <= 32 else 64 * 4096, cuda_graphs=max(32, n), **REUSE_ALL,
                              **cfg))
    sampling = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    v = vocab(shape)
    if mirrors:
        rnd = make_round(segments, 8, 8, v, seed=2) if segments else make_round(n, 100, 40, v, seed=2)
        for i, (p, sp) in enumerate(zip(rnd.prompts[:n], rnd.shared[:n])):
            eng.add(f"r{i}", p, sampling, mode="collective", shared=sp)
        eng._blend()  # prefill and first tokens: the next step is the first Mirror decode
    else:
        for i, p in enumerate(rand_prompts(n, 300, v, 0)):
            eng.add(f"r{i}", p[: 100 + 20 * i], sampling)
        while any(s.computed < len(s.prompt) for s in eng.seqs.values()):
            eng.step()
    work, _ = eng.scheduler.schedule()
    assert all(w.count == 1 for w in work) and len(work) == n
    assert all((w.seq.mirror is not None) == mirrors for w in work)
    if mirrors:
        caps = (CHUNK_CAP, *WIDE_CAPS)
        assert eng.runner.graphs._plan(work) == next(c for c in caps if max(n, segments) < c)
    graph = eng.runner.run(work)[0].clone()
    eng.runner.graphs, saved = None, eng.runner.graphs
    eager, _ = eng.runner.run(work)
    eng.runner.graphs = saved
    return float((graph - eager).norm() / eager.norm())


def overlap_vs_sync() -> tuple[list[str], int, bool]:
    """Decode with lookahead (a step's tokens feed the next on the device, the graphs'
    path) against without: the same tokens for plain sequences and Mirrors, greedy and
    seeded sampling (with min-p, top-k and top-p on one), penalties and logit bias on some
    (their counts of earlier tokens live on the device), a repetition penalty that pushes
    logits past float range, limits that end requests at different steps, and a forced
    stop token held off by min_tokens. Returns (the requests whose tokens differ, steps that
    took their ids from the device, the min_tokens request ended right after its minimum
    both ways)."""
    from tokendance.bench.allgather import make_round

    # fp32 and drawn weights: the two ways may run a step through other kernels (a stopped
    # request stays one step longer with lookahead, so a batch's Mirrors leave it a step
    # later), which in bf16 on uninitialised weights flipped near-tied tokens of one model
    # in two, run to run.
    eng = seeded(kv_tokens=16 * 4096, cuda_graphs=32)
    rnd = make_round(6, 100, 40, 49152, seed=5)
    plain = rand_prompts(8, 200, 49152, 6)
    chained, real = [0], eng.runner.run

    def spy(work, ids=None):
        chained[0] += ids is not None
        return real(work, ids) if ids is not None else real(work)

    def run(overlap: bool) -> dict[str, list[int]]:
        eng.reset_caches()
        eng.overlap = overlap
        for i, p in enumerate(plain):
            sp = SamplingParams(max_tokens=6 + 3 * i, temperature=0.8 if i % 3 == 0 else 0,
                                seed=i, ignore_eos=True, frequency_penalty=1.5 * (i % 2),
                                repetition_penalty=1.3 if i % 4 == 1 else 1.0,
                                logit_bias={7: 5.0} if i == 5 else {})
            if i == 2:  # token 7 forced, and a stop token: it may end the request from token 5 on
                sp.logit_bias, sp.stop_token_ids, sp.min_tokens = {7: 100.0}, [7], 4
            if i == 3:
                sp.min_p, sp.top_k, sp.top_p = 0.05, 40, 0.9
            if i == 6:
                sp.temperature, sp.repetition_penalty = 1.0, 1e-320
            eng.add(f"p{i}", p[: 80 + 15 * i], sp)
        for i, (p, sh) in enumerate(zip(rnd.prompts, rnd.shared)):
            eng.add(f"m{i}", p, SamplingParams(max_tokens=10 + i, temperature=0, ignore_eos=True),
                    mode="collective", shared=sh)
        toks: dict[str, list[int]] = {}
        while eng.has_work():
            for rid, d in eng.step():
                toks.setdefault(rid, []).extend(d.token_ids)
        return toks

    eng.runner.run = spy
    sync, overlap = run(False), run(True)
    held = all(len(t["p2"]) == 5 and t["p2"][-1] == 7 and 7 not in t["p2"][:4] for t in (sync, overlap))
    differ = sorted(k for k in sync.keys() | overlap.keys() if sync.get(k) != overlap.get(k))
    return [f"{k} from token {_first_difference(sync.get(k, []), overlap.get(k, []))}" for k in differ], chained[0], held


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def producer_tails() -> tuple[float, bool]:
    """Producer bases on CUDA, graphs and lookahead on: requests that end by length (their
    last token never fed) get those ends computed before their outputs are published.
    Returns the largest relative error of a plain request's published K/V against a full
    prefill of its prompt and output (fp32), and whether every Mirror's output was
    published whole too."""
    import tokendance.backend.engine as engine_module
    from tokendance.backend.keys import segment_key
    from tokendance.backend.published import Run
    from tokendance.bench.allgather import make_round

    eng = seeded(kv_tokens=16 * 4096, cuda_graphs=32, bases="producer")
    rnd = make_round(4, 100, 40, 49152, seed=7)
    plain = rand_prompts(5, 200, 49152, 8)
    for i, p in enumerate(plain):
        eng.add(f"p{i}", p[: 60 + 20 * i], SamplingParams(max_tokens=5 + 4 * i, temperature=0, ignore_eos=True),
                publish=True)
    for i, (p, sh) in enumerate(zip(rnd.prompts, rnd.shared)):
        eng.add(f"m{i}", p, SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True),
                mode="collective", shared=sh, publish=True)
    seqs = list(eng.seqs.values())
    # Random weights sample ids past the tokenizer's vocabulary, whose text is empty or
    # tokenizes apart from them: a finished output is kept as its ids, as they are.
    published = engine_module.runs
    engine_module.runs = lambda out, text, encode: [Run(0, list(out))]
    try:
        while eng.has_work():
            eng.step()
    finally:
        engine_module.runs = published
    ref = seeded(kv_tokens=16 * 4096, cuda_graphs=0, bases="producer")
    worst, whole = 0.0, True
    b = eng.cache.block_size
    for s in seqs:
        assert s.finish_reason == "length" and len(s.out) == s.sampling.max_tokens
        entry = eng.segments.get(segment_key("", s.out))
        whole &= entry is not None and entry.source == "producer" and entry.ntokens == len(s.out)
        if entry is None or s.mirror is not None:
            continue
        ref.add("ref", s.prompt + s.out, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        rseq = ref.seqs["ref"]
        ref.step()  # the prefill: its KV stays until the request finishes
        src = flat_slots(entry.blocks, torch.arange(len(s.out)), b)
        dst = flat_slots(rseq.blocks, torch.arange(len(s.prompt), len(s.prompt) + len(s.out)), b)
        for got, want in zip(eng.cache.k + eng.cache.v, ref.cache.k + ref.cache.v):
            g, w = got.view(-1, *got.shape[2:])[src], want.view(-1, *want.shape[2:])[dst]
            worst = max(worst, float((g - w).norm() / w.norm()))
        while ref.has_work():
            ref.step()
    return worst, whole


def collective_vs_tables(dtype: str, shape: str = "qwen2.5-7b") -> float:
    """Relative error of a decode step over 11 Mirrors with the Master read collectively
    (the engine's path) against the same step reading each Mirror's whole slot table."""
    from tokendance.backend.runner import step_meta
    from tokendance.bench.allgather import make_round

    eng = Engine(EngineConfig(model=str(small_folder(shape=shape)), dtype=dtype, random_weights=True,
                              kv_tokens=16 * 4096, cuda_graphs=0, **REUSE_ALL))
    rnd = make_round(11, 100, 40, vocab(shape), seed=4)
    sampling = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(rnd.prompts, rnd.shared)):
        eng.add(f"c{i}", p, sampling, mode="collective", shared=sp)
    eng._blend()
    work, _ = eng.scheduler.schedule()
    assert all(w.count == 1 and w.seq.mirror is not None for w in work)
    args = (work, eng.cache.block_size, eng.device, eng.cache.trash, eng.runner.late_from)
    ids, meta, _ = step_meta(*args, collective=True)
    _, tables, _ = step_meta(*args, collective=False)
    assert meta.master is not None and meta.late.master is not None
    with torch.inference_mode():
        got = eng.model(ids, meta, eng.cache).float()
        want = eng.model(ids, tables, eng.cache).float()
    return float((got - want).norm() / want.norm())


def greedy_vs_hf(dtype: str, shape: str = "qwen2.5-7b", layers: int = 2, length: int = 200) -> bool:
    folder = small_folder(layers, shape)
    eng = Engine(EngineConfig(model=str(folder), dtype=dtype, random_weights=True, kv_tokens=max(8192, 4 * length + 256)))
    hf = hf_model(folder, eng.dtype, torch.device("cuda"), random=True)  # eager where scores are capped
    # Same weights: ours take HF's (fused where ours are fused; a mixture's experts are
    # stacked alike in both); Qwen3's per-head norms start at ones in HF, and routers
    # near zero (routing all but uniform, decided by rounding), so both are drawn first.
    sd = hf.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                t.uniform_(0.5, 1.5)
            if name.endswith("mlp.gate.weight"):
                t.normal_(0.0, 1.0)
        for name, p in eng.model.named_parameters():
            if name in sd:
                p.copy_(sd[name])
            elif "qkv_proj" in name:
                parts = [sd[name.replace("qkv_proj", x)] for x in ("q_proj", "k_proj", "v_proj")]
                p.copy_(torch.cat(parts))
            else:
                p.copy_(torch.cat([sd[name.replace("gate_up_proj", x)] for x in ("gate_proj", "up_proj")]))
    prompts = rand_prompts(4, length, vocab(shape), 1)  # past a sliding window, if longer
    ours = [t for t, _, _ in eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    same = sum(a[: len(b)] == b for a, b in zip(ours, ref))
    first = sum(a[:1] == b[:1] for a, b in zip(ours, ref))
    with torch.no_grad():  # how flat random weights leave the first choice: rounding may decide it
        gaps = [float(hf(torch.tensor([p], device="cuda")).logits[0, -1].float().topk(2).values.diff().abs())
                for p in prompts]
    print(f"greedy vs HF ({shape}, {layers} layers, {dtype}, prompts of {length}): {same}/{len(prompts)} prompts identical, "
          f"first tokens {first}/{len(prompts)}; HF's gap between its two best first logits "
          f"{min(gaps):.3g} to {max(gaps):.3g}")
    exact = None  # HF in float32 on the same weights: the arbiter of a bf16 difference
    for p, a, b in zip(prompts, ours, ref):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        ctx = torch.tensor([p + b[:j]], device="cuda")
        with torch.no_grad():  # the same context up to j: HF's view of our token there
            logits = hf(ctx).logits[0, -1].float()
        rank = int((logits > logits[a[j]]).sum()) + 1
        print(f"  first difference at token {j}: ours is HF's choice #{rank}, its logit "
              f"{float(logits[b[j]] - logits[a[j]]):.3g} below HF's (HF's logits there up to "
              f"{float(logits.abs().max()):.3g})")
        if eng.dtype != torch.float32:
            if exact is None:
                exact = copy.deepcopy(hf).float()
            with torch.no_grad():
                f32 = exact(ctx).logits[0, -1]
            gap, top = float(f32[b[j]] - f32[a[j]]), int(f32.argmax())
            own = "HF's" if top == b[j] else "ours" if top == a[j] else "neither"
            print(f"    float32 prefers {'HF' if gap > 0 else 'ours'}, by {abs(gap):.3g}; its own choice: {own}")
    return same == len(prompts)


def mirrors() -> bool:
    """fp32: collective with every reused token recomputed = full; pic = collective; with
    reader bases too, and the two readers (prefilled in full, then Mirrors of the bases
    they gave: backend/diff.py) answer as full does; kvcomm answers as full does in its
    exact round and again over anchors of the same contexts (base + offset = exact); its
    next round answers the same restored from the host tier as predicted whole; kvcmas
    answers as full does in its exact round and predicts its next (low-rank anchors)."""
    from tokendance.bench.allgather import make_round, next_round

    rnd = make_round(4, 120, 60, 49152, seed=3)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for mode, ratio, bases in (("full", 0.15, "standalone"), ("collective", 1.0, "standalone"),
                               ("pic", 0.15, "standalone"), ("collective", 0.15, "standalone"),
                               ("pic", 0.15, "reader"), ("collective", 0.15, "reader")):
        eng = seeded(kv_tokens=16384, recompute_ratio=ratio, bases=bases)
        out[mode, ratio, bases] = [t for t, _, _ in eng.generate(rnd.prompts, greedy, mode=mode,
                                                                 shared=rnd.shared)]
    full = out["full", 0.15, "standalone"]
    a = full == out["collective", 1.0, "standalone"]
    b = out["pic", 0.15, "standalone"] == out["collective", 0.15, "standalone"]
    c = out["pic", 0.15, "reader"] == out["collective", 0.15, "reader"]
    d = out["collective", 0.15, "reader"][:2] == full[:2]
    eng = seeded(kv_tokens=16384)
    who = [f"a{i}" for i in range(rnd.agents)]

    def kvcomm(r, mode: str = "kvcomm") -> list[list[int]]:
        return [t for t, _, _ in eng.generate(r.prompts, greedy, mode=mode, shared=r.shared, agents=who)]

    first = kvcomm(rnd)  # exact: measures the places, parks each agent
    nxt = next_round(rnd, first, 60, 49152, seed=4)
    resumed = kvcomm(nxt)  # restores each agent's round 1, predicts the new outputs
    f = eng.idle.restored > 0 and eng.collector.anchored["kvcomm"].predicted == rnd.agents
    eng.reset_caches(anchors=False)  # nothing parked: the same round predicted whole
    f = f and kvcomm(nxt) == resumed
    eng.reset_caches(anchors=False)
    e = first == full and kvcomm(rnd) == full and eng.collector.anchored["kvcomm"].predicted == 3 * rnd.agents
    eng.reset_caches()
    g = kvcomm(rnd, "kvcmas") == full
    kvcomm(nxt, "kvcmas")
    g = g and eng.collector.anchored["kvcmas"].predicted == rnd.agents
    print(f"Mirrors on CUDA (fp32): ratio 1 = full {a}; pic = collective {b}; with reader bases "
          f"pic = collective {c}, readers = full {d}; kvcomm = full, exact and over anchors {e}; "
          f"kvcomm resumed = predicted whole {f}; kvcmas = full exact, then predicted {g}")
    return a and b and c and d and e and f and g


def block_sizes() -> bool:
    """vLLM's --block-size on CUDA (fp32, decode graphs, lookahead): pools of 8- and 32-slot
    blocks give what 16-slot ones give in full, prefix and collective, over a round and the
    next (whose agents resume from the host tier)."""
    from tokendance.bench.allgather import make_round, next_round

    rnd = make_round(4, 120, 60, 49152, seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    who = [f"a{i}" for i in range(rnd.agents)]
    modes, out = ("full", "prefix", "collective"), {}
    for size in (16, 8, 32):
        for mode in modes:
            eng = seeded(kv_tokens=16384, block_size=size, cuda_graphs=8)  # graphs for 4 agents' steps
            first = [t for t, _, _ in eng.generate(rnd.prompts, greedy, mode=mode, shared=rnd.shared, agents=who)]
            nxt = next_round(rnd, first, 60, 49152, seed=6)
            out[size, mode] = first, [t for t, _, _ in eng.generate(nxt.prompts, greedy, mode=mode,
                                                                    shared=nxt.shared, agents=who)]
            del eng
            gc.collect()  # an engine's model and pool, before the next is made
    same = {size: [m for m in modes if out[size, m] == out[16, m]] for size in (8, 32)}
    print(f"--block-size on CUDA (fp32): two rounds' tokens as with 16-slot blocks, at 8 in "
          f"{', '.join(same[8]) or 'no mode'}, at 32 in {', '.join(same[32]) or 'no mode'}")
    return all(len(v) == len(modes) for v in same.values())


def main() -> int:
    if sys.argv[1:] == ["blocks"]:
        return 0 if block_sizes() else 1
    if sys.argv[1:] == ["act"]:
        return 0 if act() else 1
    if sys.argv[1:] == ["memory"]:
        return 0 if memory_share() else 1
    if sys.argv[1:] == ["mirrors"]:
        ok = True
        for n, segs in ((11, 0), (20, 0), (52, 0), (4, 300)):
            err = graphs_vs_eager(mirrors=True, n=n, segments=segs)
            print(f"CUDA-graph decode vs eager over {n} Mirrors{f' of {segs} segments' if segs else ''}, "
                  f"bf16: relative error {err:.2e}")
            ok &= err < 2e-2
        for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):
            e = collective_vs_tables(dtype)
            print(f"Mirror decode, Master read collectively vs whole slot tables, {dtype}: "
                  f"relative error {e:.2e}")
            ok &= e < tol
        same, kernel, ref = diff_vs_reference()
        print(f"diff encode, 7B-shaped bf16 pool, 3,000 pairs: kernel = reference {same}; "
              f"{kernel:.3f} ms against {ref:.3f} ms ({ref / kernel:.1f}x)")
        ok &= same
        return 0 if mirrors() and ok else 1
    err = graphs_vs_eager()
    print(f"CUDA-graph decode vs eager, bf16: relative error {err:.2e}")
    ok = err < 2e-2
    err = graphs_vs_eager(mirrors=True)
    print(f"CUDA-graph decode vs eager over Mirrors, bf16: relative error {err:.2e}")
    ok &= err < 2e-2
    differ, chained, held = overlap_vs_sync()
    print(f"decode with lookahead vs without (graphs, fp32): same tokens {not differ}"
          f"{' (not ' + ', '.join(differ) + ')' if differ else ''}, {chained} steps fed from the device; "
          f"min_tokens held a forced stop token off {held}")
    ok &= not differ and chained > 0 and held
    ok &= greedy_vs_hf("float32")
    ok &= greedy_vs_hf("float32", "qwen3-8b")
    ok &= mirrors()
    ok &= block_sizes()
    err, whole = producer_tails()
    print(f"producer bases, requests ended by length (graphs, lookahead, fp32): published K/V vs "
          f"full prefill, relative error {err:.2e}; Mirrors' outputs published whole {whole}")
    ok &= err < 1e-4 and whole
    ok &= act()
    rel = deviation_parts_vs_reference()
    print(f"KV deviation's sums (tensor parallelism), 4,000 tokens, bf16: largest relative error {rel:.1e}")
    ok &= rel < 1e-4
    held = structured_after()
    print(f"structured output held after its marker (lookahead on, fp32): "
          f"{'skipped, no xgrammar' if held is None else held}")
    ok &= held is not False
    greedy_vs_hf("bfloat16")  # informational: bf16 rounding differs between implementations
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
