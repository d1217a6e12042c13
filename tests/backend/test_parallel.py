"""Tensor parallelism on the CPU (gloo): two processes serve what one does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tokendance.backend.api import InvalidRequest, Pooling, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.service import EngineBackend
from tests.backend.test_idle import GREEDY, next_round, run
from tests.backend.test_reuse import round_prompts

MODES = ("full", "prefix", "pic", "collective", "kvcomm", "kvcmas")


def engine(model, **kw) -> Engine:
    return Engine(model=str(model), dtype="float32", device="cpu", kv_tokens=8192, **kw)


def debate(eng: Engine) -> dict:
    """Two rounds of three agents in every mode, each from cold caches: greedy tokens and
    usage."""
    out = {}
    for mode in MODES:
        eng.reset_caches()
        prompts, spans = round_prompts(3, seed=5)
        toks1, use1 = run(eng, prompts, spans, mode, f"{mode}-1-")
        p2, s2 = next_round(prompts, spans, toks1, seed=6)
        toks2, use2 = run(eng, p2, s2, mode, f"{mode}-2-")
        out[mode] = (toks1, toks2, [(u.prompt_tokens, u.cached_tokens, u.recomputed_tokens,
                                     u.shared_tokens, u.kv_dense_bytes, u.kv_held_bytes)
                                    for u in use1 + use2])
    return out


@pytest.mark.parametrize("bases,kv", [("standalone", "auto"), ("reader", "auto"), ("standalone", "fp8")])
def test_two_ranks_serve_as_one(tiny_llama, bases, kv):
    one = engine(tiny_llama, bases=bases, kv_cache_dtype=kv)
    want = debate(one)
    two = engine(tiny_llama, bases=bases, kv_cache_dtype=kv, tensor_parallel_size=2)
    try:
        assert two.cache.k[0].shape[-2] == one.cache.k[0].shape[-2] // 2  # half the KV heads each
        assert two.kv_bytes_per_token == one.kv_bytes_per_token
        got = debate(two)
    finally:
        two.close()
    assert two.tp.agreed  # the follower produced the leader's tokens
    for mode in MODES:
        assert got[mode] == want[mode], mode


def chained(eng: Engine) -> dict:
    """Producer bases: each agent's answer, published, is the base the others read it from
    in round 2 (pic and collective). Also how many bases round 1 left."""
    out = {}
    agents = ["a0", "a1", "a2"]
    for mode in ("pic", "collective"):
        eng.reset_caches()
        hist = [list(range(100 + 50 * i, 140 + 60 * i)) for i in range(3)]
        answers = [t for t, _, _ in eng.generate(hist, GREEDY, mode, publish=True, agents=agents)]
        bases = len(eng.segments.entries)
        prompts, spans = [], []
        for i in range(3):
            ids, sp = hist[i] + answers[i] + [11], []
            for j in range(3):
                if j != i:
                    sp.append((len(ids), len(ids) + len(answers[j])))
                    ids += answers[j] + [11]
            prompts.append(ids + [12, 13])
            spans.append(sp)
        again = [t for t, _, _ in eng.generate(prompts, GREEDY, mode, spans, publish=True, agents=agents)]
        out[mode] = (answers, again, bases)
    return out


def test_producer_bases_as_one_process(tiny_llama):
    want = chained(engine(tiny_llama, bases="producer"))
    assert all(bases > 0 for _, _, bases in want.values())  # answers published as bases
    two = engine(tiny_llama, bases="producer", tensor_parallel_size=2)
    try:
        got = chained(two)
    finally:
        two.close()
    assert two.tp.agreed and got == want


def test_kvcmas_factors_each_ranks_heads_and_the_ranks_agree(tiny_llama):
    """At rank 2 kvcmas's anchors are low-rank factors of each rank's own heads (a single
    process factors all heads at once, so the two may differ); the ranks still agree."""
    from tokendance.backend.lowrank import LowRank

    two = engine(tiny_llama, tensor_parallel_size=2, anchor_rank=2)
    try:
        prompts, spans = round_prompts(3, seed=5)
        toks, _ = run(two, prompts, spans, "kvcmas", "k1-")
        p2, s2 = next_round(prompts, spans, toks, seed=6)
        run(two, p2, s2, "kvcmas", "k2-")
        held = [a.held_offset for anchors in two.collector.anchors.places.values() for a in anchors]
    finally:
        two.close()
    assert held and all(isinstance(x, LowRank) and x.heads == 1 for x in held)  # one KV head per rank
    assert two.tp.agreed


def served(eng: Engine) -> list:
    """Sampled answers (seeded per request, and from the engine's generator), prompt
    logprobs and an embedding."""
    out = []
    reqs = [("s", SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7), None),
            ("g", SamplingParams(max_tokens=8, temperature=1.2, top_k=50), None),
            ("p", SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1), None),
            ("e", SamplingParams(max_tokens=1), Pooling())]
    for rid, sp, pool in reqs:
        eng.add(rid, list(range(300, 340)), sp, pool=pool)
    while eng.has_work():
        for rid, d in eng.step():
            lp = [x.logprob or 0.0 for x in d.prompt_logprobs or []]
            out.append((rid, d.token_ids, [x.id for x in d.prompt_logprobs or []], lp + (d.embedding or [])))
    return out


def test_sampling_prompt_logprobs_and_embeddings_as_one_process(tiny_llama):
    want = served(engine(tiny_llama))
    assert {r for r, toks, ids, _ in want if toks or ids} >= {"s", "g", "p"}
    assert any(r == "e" and len(x) == 64 for r, _, _, x in want)  # the embedding: the hidden size
    two = engine(tiny_llama, tensor_parallel_size=2)
    try:
        got = served(two)
    finally:
        two.close()
    assert two.tp.agreed
    assert [x[:3] for x in got] == [x[:3] for x in want]
    for a, b in zip(got, want):
        assert a[3] == pytest.approx(b[3], abs=1e-4)


def test_an_abort_mid_answer_reaches_the_follower(tiny_llama):
    """A request aborted after some steps (a client gone) leaves the others' answers as one
    process gives them, and the ranks agree."""

    def answers(eng: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"a": [], "b": [], "c": []}
        for rid, start in (("a", 100), ("b", 200), ("c", 300)):
            eng.add(rid, list(range(start, start + 30)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        for n in range(100):
            if n == 3:
                eng.abort("b")
            if not eng.has_work():
                break
            for rid, d in eng.step():
                out[rid] += d.token_ids
        return out

    want = answers(engine(tiny_llama))
    two = engine(tiny_llama, tensor_parallel_size=2)
    try:
        got = answers(two)
    finally:
        two.close()
    assert two.tp.agreed and got == want and len(got["a"]) == 12 > len(got["b"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_vocabulary_the_size_does_not_divide(make_model, arch):
    """49,155 ids over two ranks: 24,578 rows each, the second's last one padding, never
    looked up and its logit dropped; Qwen2's q/k/v biases split and its tied embeddings,
    Qwen3's per-head q/k norms whole on each rank."""
    odd = make_model(arch, vocab_size=49155)
    prompts = [list(range(49140, 49155)) + [5, 6], list(range(100, 140))]  # the last ids too
    want = engine(odd).generate(prompts, GREEDY)
    two = engine(odd, tensor_parallel_size=2)
    try:
        assert two.model.model.embed_tokens.num_embeddings == 24578
        got = two.generate(prompts, GREEDY)
    finally:
        two.close()
    assert two.tp.agreed and got == want


@pytest.mark.parametrize("arch,over", [
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.5)),
    ("smollm3", dict(no_rope_layer_interval=2)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2, residual_multiplier=0.22)),
    ("gemma3", dict(num_hidden_layers=3, sliding_window=12, sliding_window_pattern=2)),
    ("gemma2", dict(num_hidden_layers=3, sliding_window=12, attn_logit_softcapping=1.0)),
])
def test_other_architectures_split_as_one_process(make_model, arch, over):
    """Phi-3's fused q, k, v and gate, up split into parts before the ranks take theirs, its
    heads' dims paired up; Granite's embeddings scaled on each rank and its residual
    multiplier folded into each rank's share; SmolLM3's NoPE layers; a mixture's experts each
    split as a dense MLP is, under a router every rank holds whole (Mixtral's names mapped
    first, GraniteMoE's tensors of every expert split into each expert's); Gemma 3's GeGLU,
    sandwich norms and two RoPEs in sliding windows; Gemma 2's capped scores."""
    folder = make_model(arch, pad_token_id=0, **over)
    prompts = [list(range(300, 317)), list(range(100, 140))]
    want = engine(folder).generate(prompts, GREEDY)
    two = engine(folder, tensor_parallel_size=2)
    try:
        got = two.generate(prompts, GREEDY)
    finally:
        two.close()
    assert two.tp.agreed and got == want


def test_a_size_the_heads_do_not_divide_by(tiny_llama, make_model):
    with pytest.raises(InvalidRequest, match="does not divide the model's 4 attention heads"):
        engine(tiny_llama, tensor_parallel_size=3)
    six = make_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(InvalidRequest, match="does not divide the model's 3 KV heads"):
        engine(six, tensor_parallel_size=2)


def test_an_engine_that_fails_to_build_stops_its_followers(tiny_llama):
    with pytest.raises(ValueError, match="needs a GPU"):
        Engine(model=str(tiny_llama), device="cpu", tensor_parallel_size=2, gpu_memory_utilization=0.5)
    two = engine(tiny_llama, tensor_parallel_size=2)  # the process can start another
    two.close()
    assert two.tp.agreed


def test_a_follower_that_cannot_start_fails_the_engine_at_once(tiny_llama):
    """A script read from stdin: the spawned follower cannot import its main module, so it
    exits before joining; the leader says so instead of waiting out the rendezvous."""
    script = ("from tokendance.backend.engine import Engine\n"
              f"Engine(model={str(tiny_llama)!r}, device='cpu', tensor_parallel_size=2)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("ChildProcessError: tensor-parallel rank tokendance-tp1 "
                                                   "exited (code 1) before it joined; its output says why")
    assert time.monotonic() - t0 < 60  # not the rendezvous's two minutes


def test_a_follower_gone_fails_the_next_step(tiny_llama):
    two = engine(tiny_llama, tensor_parallel_size=2)
    try:
        prompts, spans = round_prompts(2, seed=1)
        run(two, prompts, spans, "collective", "a")
        assert two.tp.gone() is None
        two.tp.procs[0].kill()
        two.tp.procs[0].join()
        assert two.tp.gone() == "tensor-parallel rank tokendance-tp1 exited (code -9)"
        assert EngineBackend(two).problem() == two.tp.gone()  # /health answers 503 with it
        two.add("b", prompts[0], GREEDY)
        with pytest.raises(ChildProcessError, match="tensor-parallel rank tokendance-tp1 exited"):
            two.step()
    finally:
        two.close()


def test_a_follower_that_dies_mid_step_is_named_at_once(tiny_llama):
    """Killed after it took the step's call, before the collectives it owes the leader:
    the leader's step fails with the rank's exit, not gloo's connection error, within
    seconds (not a collective's two-minute timeout)."""
    two = engine(tiny_llama, tensor_parallel_size=2)
    try:
        prompts, _ = round_prompts(2, seed=1)
        two.add("a", prompts[0], GREEDY)
        step = two._step

        def dying() -> list:
            two.tp.procs[0].kill()  # not joined: its exit shows a moment after its sockets close
            return step()

        two._step = dying
        t0 = time.monotonic()
        with pytest.raises(ChildProcessError, match=r"tensor-parallel rank tokendance-tp1 exited \(code -9\)"):
            two.step()
        assert time.monotonic() - t0 < 10
    finally:
        two.close()


def test_priority_scheduling_preempts_alike_on_every_rank(tiny_llama):
    """An urgent request preempting a running one under --scheduling-policy priority: the
    follower replays the arrivals and priorities, so its schedule, and its tokens, are the
    leader's."""
    from tests.backend.test_priority import at, run as steps
    from tests.backend.test_scheduling import prompts

    def urgent_first(eng: Engine) -> tuple[list[str], dict[str, list[int]], int]:
        out: dict[str, list[int]] = {}
        low, high = prompts(2, seed=21)
        eng.add("low", low, at(3, 30))
        steps(eng, out, steps=3)
        eng.add("high", high, at(-1))
        return steps(eng, out), out, eng.scheduler.preemptions

    want = urgent_first(engine(tiny_llama, max_seqs=1, scheduling_policy="priority"))
    two = engine(tiny_llama, max_seqs=1, scheduling_policy="priority", tensor_parallel_size=2)
    try:
        got = urgent_first(two)
    finally:
        two.close()
    assert two.tp.agreed and got == want and want[0] == ["high", "low"] and want[2] == 1


def test_each_rank_names_its_gpu_with_an_index(monkeypatch):
    """torch.cuda.set_device refuses a bare "cuda" (the default device): found on the
    H200, where two ranks checked on one GPU failed to start."""
    from tokendance.backend.parallel import ONE_DEVICE, _device

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(ONE_DEVICE, raising=False)
    assert [_device(cuda, r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert _device(torch.device("cuda", 2), 1) == torch.device("cuda", 3) and _device(cpu, 1) == cpu
    monkeypatch.setenv(ONE_DEVICE, "1")
    assert [_device(cuda, r) for r in (0, 1)] == [torch.device("cuda", 0)] * 2


def test_a_host_tier_too_small_for_each_rank_names_the_whole(tiny_llama):
    with pytest.raises(ValueError, match=r"hold not one page .*each of the 2 ranks holds 1/2 of the 1,048,576 given"):
        engine(tiny_llama, tensor_parallel_size=2, offload_bytes=1 << 20)


def test_each_ranks_host_tier_parks_as_one_process_does(tiny_llama):
    """A page holds as many tokens on a rank as in one process (2 MiB of a token's every
    head): the same budget, the same pages, so agents are parked and evicted alike (a
    rank's own 2 MiB pages held twice the tokens, half as many, and the random
    interleavings of tests/backend/test_chaos.py parted from one process's)."""
    one = engine(tiny_llama, offload_bytes=6 << 20)
    two = engine(tiny_llama, tensor_parallel_size=2, offload_bytes=6 << 20)
    two.close()
    assert two.tp.agreed
    assert (two.idle.tier.arena.capacity, two.idle.tier.arena.page) == (one.idle.tier.arena.capacity,
                                                                        one.idle.tier.arena.page) == (3, 4096)
