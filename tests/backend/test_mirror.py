"""Mirrors in the live pool: the Master is shared and never written, a Mirror holds only
its own tokens and patches, reference counts keep the Master alive, and decoding
through Mirror tables equals decoding a dense copy of the same KV."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.scheduler import Scheduled
from tokendance.kernels.master import NOT_READ, MasterRead
from tests.backend.test_reuse import round_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture()
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)


def master_kv(eng: Engine) -> dict[int, torch.Tensor]:
    return {b: torch.stack([torch.stack((k[b], v[b])) for k, v in zip(eng.cache.k, eng.cache.v)])
            for e in eng.segments.entries.values() for b in e.blocks}


def run(eng: Engine, mode: str, prompts, spans, tag: str):
    usage = {}
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        eng.add(f"{tag}{i}", p, GREEDY, mode=mode, shared=sp)
    toks = {f"{tag}{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for rid, d in eng.step():
            toks[rid] += d.token_ids
            if d.usage:
                usage[rid] = d.usage
    return [toks[f"{tag}{i}"] for i in range(len(prompts))], [usage[f"{tag}{i}"] for i in range(len(prompts))]


def test_master_is_never_written(engine):
    prompts, spans = round_prompts(4, seed=11)
    run(engine, "pic", prompts, spans, "a")  # leaves the round's bases in the segment cache
    before = master_kv(engine)
    assert before
    run(engine, "collective", prompts, spans, "b")
    after = master_kv(engine)
    assert before.keys() == after.keys()
    for b in before:
        assert torch.equal(before[b], after[b]), f"Master block {b} was written"


def test_a_mirror_holds_its_own_tokens_and_patches(engine):
    prompts, spans = round_prompts(4, seed=12)
    _, usage = run(engine, "collective", prompts, spans, "c")
    per_token = engine.kv_bytes_per_token
    for p, sp, u in zip(prompts, spans, usage):
        shared = sum(hi - lo for lo, hi in sp)
        assert u.recomputed_tokens == -(-15 * shared // 100)
        private = len(p) - shared + u.recomputed_tokens + u.completion_tokens
        assert u.kv_held_bytes == private * per_token
        assert u.kv_dense_bytes == (len(p) + u.completion_tokens) * per_token
        assert u.kv_held_bytes < 0.6 * u.kv_dense_bytes
    # What they read without holding it: the Master's blocks of the outputs each one sees.
    size = engine.cfg.block_size
    bases = {b for e in engine.segments.entries.values() for b in e.blocks}
    for p, sp, u in zip(prompts, spans, usage):
        assert u.block_bytes == size * per_token
        assert set(u.shared_blocks) <= bases
        assert len(set(u.shared_blocks)) == sum(-(-(hi - lo) // size) for lo, hi in sp)
    assert set().union(*(u.shared_blocks for u in usage)) == bases


def test_shared_blocks_of_prefix_hits_and_of_full_requests(engine):
    size = engine.cfg.block_size
    prompt = list(range(100, 100 + 5 * size + 3))
    _, (first,) = run(engine, "prefix", [prompt], [[]], "p")
    _, (second,) = run(engine, "prefix", [prompt], [[]], "q")
    assert first.shared_blocks == () and len(second.shared_blocks) == 5
    assert second.kv_held_bytes == second.kv_dense_bytes - 5 * second.block_bytes
    _, (full,) = run(engine, "full", [prompt], [[]], "f")
    assert full.shared_blocks == () and full.kv_held_bytes == full.kv_dense_bytes


def test_references_keep_the_master_alive(engine):
    """Abort one Mirror and drop the segment cache: the other still decodes exactly what
    it decodes undisturbed, and every block comes back at the end."""
    prompts, spans = round_prompts(3, seed=13)
    want, _ = run(engine, "collective", prompts, spans, "ref")
    engine.reset_caches()
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        engine.add(f"m{i}", p, GREEDY, mode="collective", shared=sp)
    got = {f"m{i}": [] for i in range(3)}
    for rid, d in engine.step():  # the group's prefill and first tokens
        got[rid] += d.token_ids
    m0 = engine.seqs["m0"].mirror
    refs = [engine.pool.refs[b] for b in m0.master_blocks]
    assert all(r >= 2 for r in refs)  # the segment cache and at least this Mirror
    engine.abort("m1")
    engine.segments.clear()
    assert all(engine.pool.refs[b] >= 1 for b in m0.master_blocks)
    assert not set(m0.master_blocks) & set(engine.pool.free)
    while engine.has_work():
        for rid, d in engine.step():
            got[rid] += d.token_ids
    assert got["m0"] == want[0] and got["m2"] == want[2]
    assert engine.pool.num_free == engine.cache.num_blocks


def test_decode_through_mirror_tables_equals_a_dense_copy(engine):
    prompts, spans = round_prompts(3, seed=14)
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        engine.add(f"x{i}", p, GREEDY, mode="collective", shared=sp)
        seqs.append(engine.seqs[f"x{i}"])
    engine.collector.prefill(seqs, "collective")
    # A dense twin of each Mirror: the K/V every layer reads, copied into its own blocks.
    b, check = engine.cache.block_size, engine.collector.cfg.check_layer
    twins = []
    for i, s in enumerate(seqs):
        engine.add(f"t{i}", s.prompt, GREEDY)
        t = engine.seqs[f"t{i}"]
        assert engine.blocks.reserve(t, len(s.prompt))
        dst = torch.tensor([t.blocks[j // b] * b + j % b for j in range(len(s.prompt))])
        for li, (k, v) in enumerate(zip(engine.cache.k, engine.cache.v)):
            view = EARLY if li < check else LATE
            src = s.read_slots(torch.arange(len(s.prompt)), view, b)
            for c in (k, v):
                flat = c.view(-1, *c.shape[2:])
                flat[dst] = flat[src]
        t.computed = len(s.prompt) - 1
        twins.append(t)
    for s in seqs:
        s.computed = len(s.prompt) - 1
    # Recompute the last prompt token of both (a one-token step through each layout).
    mirror, _ = engine.runner.run([Scheduled(s, len(s.prompt) - 1, 1) for s in seqs])
    dense, _ = engine.runner.run([Scheduled(t, len(t.prompt) - 1, 1) for t in twins])
    torch.testing.assert_close(mirror, dense, rtol=1e-4, atol=1e-4)


def many_segments(n_seg: int, seed: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Three prompts reading the same n_seg short outputs, each in its own order."""
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randint(3, 49152, (6,), generator=g).tolist() for _ in range(n_seg)]
    prompts, spans = [], []
    for _ in range(3):
        ids, sp = torch.randint(3, 49152, (20,), generator=g).tolist(), []
        for j in torch.randperm(n_seg, generator=g).tolist():
            sp.append((len(ids), len(ids) + 6))
            ids += outs[j] + [11]
        prompts.append(ids + [12, 13])
        spans.append(sp)
    return prompts, spans


@pytest.mark.parametrize("mode,wide", [("collective", 0), ("full", 0), ("collective", 1), ("collective", 2)])
def test_graph_buffers_hold_what_eager_decode_reads(engine, mode, wide):
    """The CUDA-graph path copies a step's inputs (both views' tables with Mirrors, and
    the Master read collectively) into static buffers, in full when the batch changes and
    row by row when a sequence gains a block: on the CPU, fill them (no capture) over
    decode steps that cross block boundaries and compare with the eager path's metadata.
    A batch reading CHUNK_CAP segments or more takes a wide graph's buffers."""
    from tokendance.backend.graphs import CHUNK_CAP, WIDE_CAPS, DecodeGraphs

    caps = (CHUNK_CAP, *WIDE_CAPS)
    prompts, spans = many_segments(caps[wide - 1] + 2, seed=16) if wide else round_prompts(3, seed=15)
    if wide == 2:  # room for 258 segment bases of a block each (the fixture's pool has 512)
        engine = Engine(model=engine.cfg.model, dtype="float32", kv_tokens=32768)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        engine.add(f"g{i}", p, long, mode=mode, shared=sp)
    while any(not s.out for s in engine.seqs.values()):
        engine.step()  # the prefill; the next step is a decode
    g = DecodeGraphs(engine.model, engine.cache, 4, 512 if wide == 2 else 64, engine.cache.trash_block,
                     capture=False)
    for t in (g.ids, g.pos, g.slots, g.lens, g.tables, g.master_table,
              *(t for m in g.master.values() for t in m.values()),
              *(t for v in g.views for t in v.values())):
        t.fill_(7)  # poison: every entry the step reads must be written
    want = 0 if mode == "full" else caps[wide]
    grown = 0
    for _ in range(30):
        work, _ = engine.scheduler.schedule()
        before = list(g._counts)
        _check_buffers(engine, g, work, want)
        grown += g._key is not None and before != g._counts and len(before) == len(work)
        engine.step()
    assert grown, "no sequence gained a block while its batch stayed the same"


def _check_buffers(engine, g, work, cap: int) -> None:
    from tokendance.backend.runner import step_meta

    b, mirrors = engine.cache.block_size, cap > 0
    assert len(work) == 3 and all((w.seq.mirror is not None) == mirrors and w.count == 1 for w in work)
    assert g.fits(work) and g._plan(work) == cap
    g._fill(work, 4, cap)
    ids, meta, _ = step_meta(work, b, engine.device, engine.cache.trash, engine.runner.late_from,
                             collective=True)
    assert torch.equal(g.ids[:3], ids) and torch.equal(g.pos[:3], meta.positions)
    assert torch.equal(g.slots[:3], meta.slots) and g.slots[3] == engine.cache.trash
    assert torch.equal(g.lens[:3], meta.kv_lens) and g.lens[3] == 1
    for v, m in zip(g.views if mirrors else [dict(tables=g.tables)], (meta, meta.late)):
        # Blocks and slots past a row's key count are never read.
        for i in range(3):
            n = int(m.kv_lens[i])
            nb = -(-n // b)
            assert torch.equal(v["tables"][i, :nb], m.block_tables[i, :nb])
            if mirrors:
                assert torch.equal(v["pos"][i, :n], m.slot_pos[i, :n])
        assert v["tables"][3, 0] == g.scratch_block
        if not mirrors:
            continue
        assert v["pos"][3, 0] == 0
        read, L = m.master, m.master.hide.shape[1]
        assert torch.equal(v["hide"][:3, :L], read.hide)
        assert torch.equal(g.master_table[: len(read.table)], read.table)
        # Eager steps plan chunks freely, graphs into a fixed count: compare what each
        # Mirror reads, slot by slot: the position of every Master slot it sees.
        seen = [_reads(read, i, b) for i in range(3)]
        m = g.master[cap]
        graph = MasterRead(g.master_table, m["chunks"], m["shift"], v["hide"])
        assert [_reads(graph, i, b) for i in range(3)] == seen
        assert _reads(graph, 3, b) == {}
        assert all(seen)


def _reads(read, s: int, block_size: int) -> dict[int, int]:
    """Pool slot -> position of every Master slot sequence s reads."""
    out = {}
    for c, (lo, hi, base) in enumerate(read.chunks.tolist()):
        sh = int(read.shift[s, c])
        for j in range(lo, hi):
            if sh < NOT_READ and not read.hide[s, j]:
                out[int(read.table[j // block_size]) * block_size + j % block_size] = sh + j - base
    return out


@pytest.fixture(scope="module")
def four_layers(make_model):
    return make_model("llama", num_hidden_layers=4)


@pytest.mark.parametrize("ratio", [0.15, 1.0])
def test_later_check_layer(four_layers, ratio):
    """Check layer 2: layer 1 is recomputed for every token, so every reused token has a
    private slot in the early view; pic = collective, and ratio 1 = full."""
    prompts, spans = round_prompts(3, seed=16)
    outs = {}
    for mode in ("full", "pic", "collective"):
        eng = Engine(model=str(four_layers), dtype="float32", kv_tokens=8192, check_layer=2,
                     recompute_ratio=ratio)
        toks, usage = run(eng, mode, prompts, spans, mode)
        outs[mode] = toks
        if mode != "full":
            for p, sp, u in zip(prompts, spans, usage):
                assert u.kv_held_bytes == (len(p) + u.completion_tokens) * eng.kv_bytes_per_token
    assert outs["pic"] == outs["collective"]
    if ratio == 1.0:
        assert outs["collective"] == outs["full"]


def test_collective_decode_equals_whole_tables(tiny_llama):
    """A decode step reading the batch's Master collectively (the CUDA path, here through
    its torch reference) gives the logits of reading each Mirror's whole slot table."""
    from tokendance.backend.runner import step_meta

    # the step is built here from the sequences' tokens: none may still be on the device
    engine = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, overlap=False)
    prompts, spans = round_prompts(4, seed=17)
    for i, (p, sp) in enumerate(zip(prompts, spans)):
        engine.add(f"d{i}", p, GREEDY, mode="collective", shared=sp)
    while any(not s.out for s in engine.seqs.values()):
        engine.step()
    work, _ = engine.scheduler.schedule()
    args = (work, engine.cache.block_size, engine.device, engine.cache.trash, engine.runner.late_from)
    ids, meta, _ = step_meta(*args, collective=True)
    _, tables, _ = step_meta(*args, collective=False)
    assert meta.master is not None and meta.late.master is not None and tables.master is None
    with torch.inference_mode():
        got, want = engine.model(ids, meta, engine.cache), engine.model(ids, tables, engine.cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
