"""Random interleavings of what a server does to its engine: requests of every mode and
priority arriving mid-step, agents whose next request extends their last one and quotes
the others' outputs, aborts at any moment, in a pool too small for all of them. Whatever
the order, each request that is not aborted ends once, with exact prefill's tokens
wherever it and the prefix it restores were computed exactly (reuse recomputes
everything here: ratio 1; kvcomm and kvcmas predict), and every block comes back."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.async_engine import AsyncEngine, Job
from tokendance.backend.engine import Engine

EXACT = ("full", "prefix", "pic", "collective")  # at recompute ratio 1, exact prefill
MODES = (*EXACT, "kvcomm", "kvcmas")  # anchored ones predict offsets: checked for ending, not tokens
AGENT_MODES = {"a": "collective", "b": "pic", "c": "kvcomm"}
# On a GPU too (bash bench/h200.sh check): "cuda", a tiny model of head dim 32: CUDA graphs,
# the Triton kernels, the pinned host tier; "cuda-d16", the usual tiny model, whose head dim
# the Triton kernels tile in halves padded from 8 columns to 16.
DEVICES = ["cpu", *(["cuda", "cuda-d16"] if torch.cuda.is_available() else [])]


@dataclass
class Req:
    prompt: list[int]
    mode: str
    max_tokens: int
    agent: str | None
    got: list[int] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    aborted: bool = False
    parker: Req | None = None  # the agent's request whose parked KV this one restores

    @property
    def exact(self) -> bool:
        """Its tokens are exact prefill's: it and what it restores computed exactly
        (a restored prefix is as exact as the request that parked it)."""
        if self.mode in ("full", "prefix"):  # they restore nothing, and cache exact blocks only
            return True
        return self.mode in EXACT and (self.parker is None or self.parker.exact)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def prompt_for(rng: random.Random, last: Req | None, done: list[Req]) -> tuple[list[int], list[tuple[int, int]]]:
    """An agent's next prompt: its last prompt and answer (when it has one), then up to
    three finished answers of others as shared spans, then a few tokens of its own."""
    go_on = bool(last is not None and last.got and len(last.prompt) < 120)
    ids = (last.prompt + last.got + [11]) if go_on else fresh(rng, rng.randrange(8, 40))
    spans = []
    for other in rng.sample(done, min(len(done), rng.randrange(0, 4))):
        if len(other.got) >= 2 and len(ids) < 180:
            spans.append((len(ids), len(ids) + len(other.got)))
            ids += other.got + [11]
    return ids + fresh(rng, rng.randrange(1, 6)), spans


def play(eng: Engine, rng: random.Random, requests: int) -> dict[str, Req]:
    ranked = eng.cfg.scheduling_policy == "priority"
    reqs: dict[str, Req] = {}
    last: dict[str, Req] = {}
    # An agent's KV is parked when its request of a reusing mode finishes (the engine's
    # full and prefix ones park nothing): an agent's later request restores the last such
    # one's, which may lie before the request its prompt extends.
    parked: dict[str, Req] = {}
    live: set[str] = set()
    n = 0
    while n < requests or eng.has_work():
        roll = rng.random()
        if n < requests and roll < 0.6:
            agent = rng.choice(["a", "b", "c", "d", None])
            if agent in last and not (last[agent].ends or last[agent].aborted):
                agent = None  # an agent waits for its answer before it speaks again
            done = [r for r in reqs.values() if r.ends]
            before = last.get(agent) if agent else None
            prompt, spans = prompt_for(rng, before, done)
            # an agent keeps its mode, mostly (d and one request in five choose afresh)
            mode = AGENT_MODES.get(agent) if agent and rng.random() < 0.8 else None
            r = Req(prompt, mode or rng.choice(MODES), rng.randrange(1, 9), agent)
            sp = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True,
                                priority=rng.choice([0, 0, 1, 2]) if ranked else 0)
            rid = f"r{n}"
            eng.add(rid, prompt, sp, mode=r.mode, shared=spans, agent=agent, publish=rng.random() < 0.5)
            if eng.seqs[rid].resume is not None:
                r.parker = parked[agent]
            reqs[rid], n = r, n + 1
            live.add(rid)
            if agent is not None:
                last[agent] = r
        elif live and roll < 0.67:
            rid = rng.choice(sorted(live))
            assert eng.abort(rid)
            reqs[rid].aborted = True
            live.discard(rid)
        if eng.has_work():
            for rid, d in eng.step():
                r = reqs[rid]
                assert not r.aborted and not r.ends, f"{rid} answered after it ended"
                r.got += d.token_ids
                if d.finish_reason:
                    r.ends.append(d.finish_reason)
                    live.discard(rid)
                    if r.agent is not None and r.mode not in ("full", "prefix"):
                        parked[r.agent] = r
    return reqs


def alone(model, reqs: list[Req], device: str = "cpu") -> list[list[int]]:
    """Each request's tokens alone in a fresh engine, no reuse: exact prefill's."""
    ref = Engine(model=str(model), dtype="float32", device=device, kv_tokens=16 * 1024)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    return [toks for toks, _, _ in ref.generate([r.prompt for r in reqs], params)]


@pytest.fixture(scope="module")
def wide_llama(make_model) -> str:
    """A tiny Llama of head dim 32, which the Triton kernels tile."""
    return str(make_model("llama", hidden_size=128, head_dim=32))


@pytest.fixture
def where(request, tiny_llama) -> tuple[str, str]:
    """(model folder, device) for a DEVICES entry."""
    if request.param != "cuda":
        return str(tiny_llama), request.param.removesuffix("-d16")
    return request.getfixturevalue("wide_llama"), "cuda"


def tight(model, device: str = "cpu", **kw) -> Engine:
    """An engine whose pool holds a few of these requests at a time (prompts up to ~200
    tokens), and whose host tier a few agents."""
    return Engine(model=str(model), dtype="float32", device=device, kv_tokens=16 * 16, max_batched_tokens=96,
                  max_seqs=6, recompute_ratio=1.0, min_shared_tokens=0, offload_bytes=8 << 20, **kw)


# seeds whose interleavings preempt, restore and abort (the test asserts they do); overlap:
# lookahead decode (a GPU's default), its next step launched before the host reads this one
@pytest.mark.parametrize(("seed", "policy", "bases", "overlap"), [
    (3, "priority", "standalone", False), (2, "priority", "reader", False), (7, "fcfs", "producer", False),
    (29, "fcfs", "standalone", False), (3, "priority", "standalone", True), (10, "fcfs", "producer", True)])
@pytest.mark.parametrize("where", DEVICES, indirect=True)
def test_any_interleaving_ends_each_request_once_exactly_and_leaks_nothing(where, seed, policy, bases, overlap):
    model, device = where
    eng = tight(model, device, scheduling_policy=policy, bases=bases, overlap=overlap)
    reqs = play(eng, random.Random(seed), requests=40)
    kept = {rid: r for rid, r in reqs.items() if not r.aborted}
    for rid, r in kept.items():
        assert r.ends == ["length"] and len(r.got) == r.max_tokens, rid
    exact = [r for r in kept.values() if r.exact]
    assert [r.got for r in exact] == alone(model, exact, device)
    # what the interleaving was to exercise: a full pool, agents restored, aborts
    assert eng.scheduler.preemptions and any(r.aborted for r in reqs.values())
    assert any(r.parker is not None for r in exact)
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks and not eng.idle.parked and eng.idle.bytes == 0 and not eng.seqs


def test_two_ranks_follow_any_interleaving(tiny_llama):
    """Tensor parallelism relays every call (adds mid-step, aborts, priorities): the
    follower stays in lockstep and the pair answers as one process does (kvcmas aside: each
    rank factors its own heads)."""
    want = play(tight(tiny_llama, scheduling_policy="priority"), random.Random(3), requests=40)
    two = tight(tiny_llama, scheduling_policy="priority", tensor_parallel_size=2)
    try:
        got = play(two, random.Random(3), requests=40)
        assert two.scheduler.preemptions and two.idle.restored
    finally:
        two.close()
    assert two.tp.agreed
    assert {rid: (r.got, r.ends, r.aborted) for rid, r in got.items() if r.mode != "kvcmas"} == \
        {rid: (r.got, r.ends, r.aborted) for rid, r in want.items() if r.mode != "kvcmas"}


@pytest.mark.parametrize("where", DEVICES, indirect=True)
async def test_clients_that_come_and_go_on_the_engine_thread_get_their_own_answers(where):
    """The server's side of it: groups of requests submitted from many tasks while the
    engine thread steps, some streams abandoned after a few tokens, some aborted before
    their first. Every stream read to its end gets exact prefill's tokens, and once all
    are done every block is back."""
    model, device = where
    eng = tight(model, device, scheduling_policy="priority", overlap=True)  # a GPU's default
    core = AsyncEngine(eng)
    finished: list[Req] = []  # in the order they ended: later prompts quote their answers
    early: set[str] = set()  # aborted right after submitting
    made: dict[str, int] = {}  # tokens the engine produced, by request
    step = eng.step

    def noting() -> list:
        out = step()
        for rid, d in out:
            made[rid] = made.get(rid, 0) + len(d.token_ids)
        return out

    eng.step = noting

    async def client(i: int) -> None:
        rng = random.Random(i)  # its own: what it does does not hang on the threads' timing
        delay, size, leave = rng.random() * 0.3, rng.randrange(1, 4), rng.random()
        await asyncio.sleep(delay)
        reqs, jobs = [], []
        for j in range(size):  # a group, started in one step
            prompt, spans = prompt_for(rng, None, finished)
            r = Req(prompt, rng.choice(EXACT), rng.randrange(1, 9), None)
            sp = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, priority=rng.choice([0, 1]))
            reqs.append(r)
            jobs.append(Job(f"c{i}-{j}", prompt, sp, r.mode, spans))
        streams = core.submit(jobs)
        for r, stream in zip(reqs, streams):
            if leave < 0.15:
                stream.abort()  # gone at once, maybe before its add
                r.aborted = True
                early.add(stream.rid)
                continue
            async for d in stream:
                r.got += d.token_ids
                if d.finish_reason:
                    r.ends.append(d.finish_reason)
                elif leave < 0.3 and len(r.got) >= 2:
                    stream.abort()  # the client hung up mid-answer
                    r.aborted = True
                    break
            if not r.aborted:
                finished.append(r)

    async def crowd() -> None:
        """Three prompts of five blocks each, first in the queue, grow a sixth block each as
        they decode: 18 blocks in a pool of 16 preempt one of them whatever the timing."""
        rng = random.Random(-1)
        reqs = [Req(fresh(rng, 80), "prefix", 8, None) for _ in range(3)]
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, priority=0)
        streams = core.submit([Job(f"crowd-{j}", r.prompt, sp, r.mode, []) for j, r in enumerate(reqs)])
        for r, stream in zip(reqs, streams):
            async for d in stream:
                r.got += d.token_ids
                if d.finish_reason:
                    r.ends.append(d.finish_reason)
            finished.append(r)

    await asyncio.wait_for(asyncio.gather(crowd(), *(client(i) for i in range(24))), 120)
    await core.close()
    # the abort reaches the engine thread before its next step, or the one after
    assert not eng.seqs and early and all(made.get(rid, 0) <= 1 for rid in early)
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks
    assert all(r.ends == ["length"] and len(r.got) == r.max_tokens for r in finished)
    assert [r.got for r in finished] == alone(model, finished, device)
    assert len(finished) > 20 and len(early) >= 3 and eng.scheduler.preemptions
