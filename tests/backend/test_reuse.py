"""Reuse modes: collective equals pic per request; ratio 1 equals full; bases once per round."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.mirror import EARLY, LATE

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def round_prompts(n_agents: int, seed: int, hist: int = 40, out: int = 30):
    """An All-Gather round: private history, then every other agent's output."""
    g = torch.Generator().manual_seed(seed)
    outputs = [torch.randint(3, 49152, (out + 3 * j,), generator=g).tolist() for j in range(n_agents)]
    prompts, spans = [], []
    for i in range(n_agents):
        ids = torch.randint(3, 49152, (hist + 7 * i,), generator=g).tolist()
        sp = []
        for j, o in enumerate(outputs):
            if j != i:
                sp.append((len(ids), len(ids) + len(o)))
                ids += o + [11]  # a private separator token between blocks
        ids += [12, 13]
        prompts.append(ids)
        spans.append(sp)
    return prompts, spans


def kv_of(eng: Engine, seq) -> torch.Tensor:
    """[layers, 2, prompt tokens, Hkv, D]: the K/V each layer reads for the prompt (a
    Mirror's from its own slots or the Master, by layer)."""
    b, check = eng.cache.block_size, eng.collector.cfg.check_layer
    out = []
    for li, (k, v) in enumerate(zip(eng.cache.k, eng.cache.v)):
        view = EARLY if li < check else LATE
        slots = seq.read_slots(torch.arange(len(seq.prompt)), view, b)
        out.append(torch.stack([k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]]))
    return torch.stack(out)


def prefill(eng: Engine, mode: str, prompts, spans, ratio: float | None = None):
    if ratio is not None:
        eng.collector.cfg.ratio = ratio
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"{mode}-{i}", p, GREEDY, mode=mode, shared=sp)
        seqs.append(eng.seqs[f"{mode}-{i}"])
    ready, logits = eng.collector.prefill(seqs, mode)
    assert ready == seqs
    return seqs, logits


@pytest.fixture()
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)


def test_collective_equals_pic(engine):
    prompts, spans = round_prompts(4, seed=1)
    pic, pic_logits = prefill(engine, "pic", prompts, spans)
    pic_kv = [kv_of(engine, s) for s in pic]
    col, col_logits = prefill(engine, "collective", prompts, spans)
    for a, b, ka in zip(pic, col, pic_kv):
        assert a.recomputed == b.recomputed > 0
        torch.testing.assert_close(kv_of(engine, b), ka, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(col_logits, pic_logits, rtol=1e-4, atol=1e-4)


def test_same_selection_and_greedy_output(tiny_llama):
    prompts, spans = round_prompts(5, seed=2)
    outs = {}
    for mode in ("pic", "collective"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
        outs[mode] = eng.generate(prompts, GREEDY, mode=mode, shared=spans)
    assert [t for t, _, _ in outs["pic"]] == [t for t, _, _ in outs["collective"]]


def test_selected_tokens_identical(engine, monkeypatch):
    from tokendance.backend import blend as blend_mod

    seen: dict[str, list] = {"pic": [], "collective": []}
    real = blend_mod.blend

    def spy(model, cache, items, *a):
        res = real(model, cache, items, *a)
        seen[current].extend(res.selected)
        return res

    monkeypatch.setattr("tokendance.backend.collector.blend", spy)
    prompts, spans = round_prompts(3, seed=3)
    for current in ("pic", "collective"):
        prefill(engine, current, prompts, spans)
    assert seen["pic"] == seen["collective"] and all(seen["pic"])


# 600: two forwards (four prompts of ~200 tokens); 100: the four bases (~35 tokens) in
# two, every prompt alone (six forwards: only the first AHEAD run ahead).
@pytest.mark.parametrize("budget, forwards", [(0, 1), (600, 2), (100, 6)])
def test_early_layers_run_before_the_mirrors_exist(tiny_llama, monkeypatch, budget, forwards):
    """A cold collective round queues its first forwards' layers before the check layer
    ahead of building its Mirrors (blend.early), and the blend stores their K/V where the
    Mirrors say instead of computing them again: the same selection, KV and logits as
    computing them inside the blend."""
    from tokendance.backend import collector as col

    prompts, spans = round_prompts(4, seed=12)
    got = []
    for ahead in (True, False):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
        eng.collector.cfg.max_tokens = budget
        embeds, calls = [], []
        embed, real_early = eng.model.embed, col.early
        monkeypatch.setattr(eng.model, "embed", lambda ids: embeds.append(len(ids)) or embed(ids))
        monkeypatch.setattr(col, "early", lambda *a: calls.append(a) or (real_early(*a) if ahead else None))
        seqs, logits = prefill(eng, "collective", prompts, spans)
        got.append(([s.recomputed for s in seqs], [kv_of(eng, s) for s in seqs], logits))
        monkeypatch.undo()
        assert len(embeds) == forwards  # computed once, ahead or in the blend
        assert len(calls) == min(forwards, col.AHEAD)
    (r1, k1, l1), (r2, k2, l2) = got
    assert r1 == r2 and all(r1)
    for a, b in zip(k1, k2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)


def test_full_recompute_equals_full_prefill(engine):
    prompts, spans = round_prompts(3, seed=4)
    ref = [kv_of(engine, s) for s in prefill_full(engine, prompts)]
    seqs, _ = prefill(engine, "collective", prompts, spans, ratio=1.0)
    for s, want in zip(seqs, ref):
        torch.testing.assert_close(kv_of(engine, s), want, rtol=1e-4, atol=1e-5)


def prefill_full(eng: Engine, prompts):
    from tokendance.backend.scheduler import Scheduled

    seqs = []
    for i, p in enumerate(prompts):
        eng.add(f"full-{i}", p, GREEDY)
        seq = eng.seqs[f"full-{i}"]
        assert eng.blocks.reserve(seq, len(p))
        seqs.append(seq)
    eng.runner.run([Scheduled(s, 0, len(s.prompt)) for s in seqs])
    return seqs


def test_ratio_one_gives_full_greedy_output(tiny_llama):
    prompts, spans = round_prompts(3, seed=5)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_ratio=1.0)
    full = eng.generate(prompts, GREEDY)
    assert eng.generate(prompts, GREEDY, mode="collective", shared=spans) == full


def test_qwen3_reuses_its_normed_keys(tiny_models):
    """Qwen3 norms each head's k before RoPE: the pool holds the normed keys, so reuse
    works as for the others."""
    reuses_as_llama_does(tiny_models["qwen3"])


def reuses_as_llama_does(folder) -> None:
    """Ratio 1 gives full's tokens; collective equals pic (the same tokens recomputed, the
    same KV and logits)."""
    prompts, spans = round_prompts(3, seed=6)
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, recompute_ratio=1.0)
    full = eng.generate(prompts, GREEDY)
    assert eng.generate(prompts, GREEDY, mode="collective", shared=spans) == full
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192)
    seqs, logits = prefill(eng, "pic", prompts, spans)
    kv = [kv_of(eng, s) for s in seqs]
    col, col_logits = prefill(eng, "collective", prompts, spans)
    assert [s.recomputed for s in col] == [s.recomputed for s in seqs] and all(s.recomputed for s in col)
    for a, b in zip(col, kv):
        torch.testing.assert_close(kv_of(eng, a), b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(col_logits, logits, rtol=1e-4, atol=1e-4)


def test_bases_prefilled_once_per_round(tiny_llama, monkeypatch):
    """Each unique segment is computed once per round: in collective's one blend forward,
    beside the Mirrors that read it; in pic's one standalone forward before them."""
    from tokendance.backend import blend as blend_mod

    prompts, spans = round_prompts(4, seed=6)
    runs, blends = [], []
    monkeypatch.setattr("tokendance.backend.collector.blend", lambda m, c, items, *a: blends.append(
        sum(it.seq.mirror is None for it in items)) or blend_mod.blend(m, c, items, *a))
    for mode in ("collective", "pic"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
        real = eng.runner.run
        monkeypatch.setattr(eng.runner, "run", lambda work: runs.append(len(work)) or real(work))
        runs.clear()
        blends.clear()
        prefill(eng, mode, prompts, spans)
        if mode == "collective":
            assert runs == [] and blends == [4]  # one forward: four unique segments, four Mirrors
        else:
            assert runs == [4] and blends == [0] * 4  # one forward of the segments, then each request
        assert len(eng.segments.entries) == 4
        for s in eng.seqs.values():
            assert s.cached + s.recomputed == sum(hi - lo for lo, hi in s.shared)
        runs.clear()
        blends.clear()
        prefill(eng, "pic" if mode == "collective" else "collective", prompts, spans)
        assert runs == [] and sum(blends) == 0  # the next round of the same outputs: none again


def test_bases_in_the_blend_forward_equal_standalone(tiny_llama):
    """Bases computed beside their readers (collective, cold) leave the same Master, the
    same selection and KV, and the same logits as bases prefilled alone first (pic)."""
    prompts, spans = round_prompts(4, seed=11)
    got = {}
    for mode in ("pic", "collective"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
        seqs, logits = prefill(eng, mode, prompts, spans)
        # kv_of reads each prompt's reused tokens from the Master: the bases are compared too
        got[mode] = ([s.recomputed for s in seqs], [kv_of(eng, s) for s in seqs], logits)
    (rp, kp, lp), (rc, kc, lc) = got["pic"], got["collective"]
    assert rp == rc and all(rp)
    for a, b in zip(kp, kc):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lc, lp, rtol=1e-4, atol=1e-4)


def test_a_failed_round_leaves_no_empty_base(tiny_llama, monkeypatch):
    """Collective enters a round's bases in the segment cache before its forward computes
    them. If the round fails first, they leave the cache again: the next round computes
    them instead of reading empty blocks, and nothing leaks."""
    prompts, spans = round_prompts(3, seed=13)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)

    def lost(*a):
        raise RuntimeError("device lost")

    monkeypatch.setattr("tokendance.backend.collector.blend", lost)
    with pytest.raises(RuntimeError, match="device lost"):
        prefill(eng, "collective", prompts, spans)
    assert not eng.segments.entries
    monkeypatch.undo()
    for rid in list(eng.seqs):  # what the server does with a failed step's requests
        eng.abort(rid)
    _, logits = prefill(eng, "collective", prompts, spans)
    _, want = prefill(Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192), "collective", prompts, spans)
    torch.testing.assert_close(logits, want)
    for rid in list(eng.seqs):
        eng.abort(rid)
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks


def test_usage_reports_reuse(engine):
    prompts, spans = round_prompts(2, seed=7)
    engine.add("u", prompts[0], SamplingParams(max_tokens=2, temperature=0), mode="collective", shared=spans[0])
    usage = None
    while engine.has_work():
        for _, d in engine.step():
            usage = d.usage or usage
    shared = sum(hi - lo for lo, hi in spans[0])
    assert usage.shared_tokens == shared
    assert usage.recomputed_tokens == -(-15 * shared // 100)
    assert usage.cached_tokens == shared - usage.recomputed_tokens


def test_group_larger_than_pool_still_completes(tiny_llama):
    """Bases and prompts that cannot all fit: requests run in turns or fall back to plain
    prefill; every one finishes and no block leaks."""
    prompts, spans = round_prompts(4, seed=8)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16 * 24, max_model_len=1024)
    res = eng.generate(prompts, GREEDY, mode="collective", shared=spans)
    assert all(reason == "length" and len(toks) == 10 for toks, _, reason in res)
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks


def budget_round(folder, mode: str, budget: int, prompts, spans, monkeypatch):
    """Run a round to the end under max_batched_tokens=budget; per request its greedy
    tokens, (recomputed, cached) and selected positions, and the blend calls by step."""
    from tokendance.backend import blend as blend_mod

    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=budget)
    step, calls, forwards, selected = 0, [], [], {}

    def spy(model, cache, items, *a):
        res = blend_mod.blend(model, cache, items, *a)
        calls.append((step, [len(it.seq.prompt) for it in items]))
        selected.update((it.seq.id, sel) for it, sel in zip(items, res.selected) if it.seq.mirror is not None)
        return res

    monkeypatch.setattr("tokendance.backend.collector.blend", spy)
    run = eng.runner.run
    monkeypatch.setattr(eng.runner, "run",  # *a: a lookahead step's tokens on the device
                        lambda work, *a: forwards.append(sum(w.count for w in work)) or run(work, *a))
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"r{i}", p, GREEDY, mode=mode, shared=sp)
    toks: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    usage = {}
    while eng.has_work():
        for rid, d in eng.step():
            toks[rid] += d.token_ids
            if d.usage:
                usage[rid] = (d.usage.recomputed_tokens, d.usage.cached_tokens)
        step += 1
    assert max(forwards) <= budget  # bases and the scheduler's forwards
    for _, lens in calls:  # each blend forward: the budget, or one request
        assert sum(lens) <= budget or len(lens) == 1
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks
    return toks, usage, selected, calls


@pytest.mark.parametrize("budget", [450, 120])  # 120: every prompt is longer than the budget
def test_collective_within_token_budget(tiny_llama, monkeypatch, budget):
    prompts, spans = round_prompts(5, seed=9)  # prompts of ~200 tokens
    ref = budget_round(tiny_llama, "collective", 16384, prompts, spans, monkeypatch)
    assert len(ref[3]) == 1  # one batched blend for the whole round
    small = budget_round(tiny_llama, "collective", budget, prompts, spans, monkeypatch)
    pic = budget_round(tiny_llama, "pic", budget, prompts, spans, monkeypatch)
    assert len(small[3]) > 1  # several sub-batches
    if budget == 450:
        assert max(len(ls) for _, ls in small[3]) > 1  # still batched
    assert all(len(toks) == 10 for toks in small[0].values())
    for got in (small, pic):
        assert got[:3] == ref[:3]


def test_idle_engine_takes_the_whole_round_in_one_step(tiny_llama, monkeypatch):
    """Sub-batches run one per step while other sequences decode, so those decode
    between them; with nothing else running, one step takes them all back to back."""
    prompts, spans = round_prompts(5, seed=9)
    steps = {}
    for busy in (False, True):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, max_batched_tokens=450)
        if busy:
            eng.add("other", [5] * 20, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
            eng.step()  # prefilled: it decodes from now on
        calls = []
        real = eng.collector.prefill
        monkeypatch.setattr(eng.collector, "prefill", lambda g, mode: calls.append(len(g)) or real(g, mode))
        for i, (p, sp) in enumerate(zip(prompts, spans)):
            eng.add(f"r{i}", p, GREEDY, mode="collective", shared=sp)
        n, decoded = 0, 0
        while eng.waiting.seqs:
            decoded += sum(rid == "other" for rid, _ in eng.step())
            n += 1
        steps[busy] = (n, calls, decoded)
    assert steps[False][:2] == (1, [5])
    n, calls, decoded = steps[True]
    assert n == len(calls) > 1 and sum(calls) == 5 and max(calls) < 5
    assert decoded >= n - 1  # the running sequence decoded between sub-batches


def test_collector_splits_group_by_budget(tiny_llama, monkeypatch):
    from tokendance.backend import blend as blend_mod

    sizes = []
    monkeypatch.setattr("tokendance.backend.collector.blend",
                        lambda m, c, items, *a: sizes.append(len(items)) or blend_mod.blend(m, c, items, *a))
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, max_batched_tokens=450)
    prompts, spans = round_prompts(5, seed=9)
    _, pic_logits = prefill(eng, "pic", prompts, spans)
    sizes.clear()
    _, col_logits = prefill(eng, "collective", prompts, spans)
    assert sizes == [1, 2, 2]  # the remainder first
    torch.testing.assert_close(col_logits, pic_logits, rtol=1e-4, atol=1e-4)
