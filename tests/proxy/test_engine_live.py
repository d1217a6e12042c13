"""The real openai SDK against a live server running the real engine on a tiny random model."""

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.prompt import render_chat
from tokendance.proxy.segment import SEP


@pytest.fixture(scope="module")
def model(engine_live) -> str:
    return engine_live.backend.info.name


@pytest.fixture(scope="module")
def client(engine_live) -> openai.OpenAI:
    return engine_live.client()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def marked(c: openai.AsyncOpenAI, model: str, text: str, session: str, agent: str, r: int,
                 mode: str) -> openai.types.chat.ChatCompletion:
    """A three-token greedy turn of a session's agent, its shared block marked by separators."""
    return await c.chat.completions.create(
        model=model, messages=user(text), max_tokens=3, temperature=0,
        extra_body={"tokendance": {"session": session, "agent": agent, "round": r, "separators": True,
                                   "mode": mode}})


def test_the_model_is_served_by_its_path_as_given(client, model, tiny_llama):
    """vLLM's served name without --served-model-name: the model argument itself, so a
    client set up for `vllm serve /path/to/folder` finds it here too."""
    assert model == str(tiny_llama) and [m.id for m in client.models.list()] == [str(tiny_llama)]
    assert client.models.retrieve(model).id == model  # /v1/models/{id} with the path's slashes
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=tiny_llama.name, prompt="hi", max_tokens=1)


def test_sync_stream_equals_whole_answer(client, model):
    kw = dict(model=model, messages=user("Tell me a story."), max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_with_token_ids_logprobs_and_n(client, model):
    r = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0, n=2,
                                  logprobs=2)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8


def test_without_a_length_a_chat_ends_with_the_context_and_a_completion_at_16(tiny_llama):
    """vLLM's defaults: a chat without max_tokens goes on to the end of the context, a
    completion (OpenAI's legacy API) stops at 16 tokens."""
    from tokendance.backend.service import EngineBackend

    from .conftest import Threaded

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full", max_model_len=96))
    try:
        c, name = t.client(), t.backend.info.name
        chat = c.chat.completions.create(model=name, messages=user("Go on."), temperature=0,
                                         extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.usage.total_tokens == 96
        text = c.completions.create(model=name, prompt="Go on.", temperature=0, extra_body={"ignore_eos": True})
        assert (text.choices[0].finish_reason, text.usage.completion_tokens) == ("length", 16)
        longer = c.completions.create(model=name, prompt="Go on.", temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 20})
        assert longer.usage.completion_tokens == 20  # the default length grows to min_tokens
    finally:
        t.close()


def test_prompt_longer_than_the_context_is_a_400(client, model, engine_live):
    n = engine_live.backend.info.max_model_len
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[5] * (n + 1), max_tokens=1)


async def test_async_round_is_one_group_and_reuses_shared_blocks(engine_live, model):
    c = openai.AsyncOpenAI(base_url=engine_live.url + "/v1", api_key="sk-test", max_retries=0)
    agents = ["a", "b", "c", "d"]
    block = " ".join(f"fact{i}" for i in range(40))

    def turn(a: str, r: int):
        return marked(c, model, f"I am {a}.{SEP}{block}{SEP}Answer briefly.", "eng", a, r, "collective")

    async with httpx.AsyncClient() as http:
        opened = await http.post(engine_live.url + "/v1/tokendance/sessions/eng/rounds/1",
                                 json={"agents": agents})
        assert opened.status_code == 200
        before = metrics(await http.get(engine_live.url + "/metrics"))
        shared = 0
        for r in (1, 2):
            t0 = time.perf_counter()
            rs = await asyncio.gather(*[turn(a, r) for a in agents])
            # Released by the arrivals (announced, then inferred), not by the 10 s timeout.
            assert time.perf_counter() - t0 < 5.0
            assert all(x.choices[0].finish_reason == "length" for x in rs)
            stats = (await http.get(engine_live.url + f"/v1/tokendance/sessions/eng/rounds/{r}")).json()
            assert (stats["groups"], stats["requests"]) == (1, 4) and stats["shared_tokens"] > 0
            # The KV accounting: the block of facts held once (the Master), read by all four.
            assert 0 < stats["kv_shared_bytes"] < stats["kv_dense_bytes"]
            held = stats["kv_held_bytes"] + stats["kv_shared_bytes"]
            assert stats["kv_ratio"] == round(stats["kv_dense_bytes"] / held, 3) > 1
            mine = stats["per_agent"]
            assert sorted(mine) == agents
            for key in ("prompt_tokens", "reused_tokens", "recomputed_tokens", "kv_held_bytes"):
                assert sum(m[key] for m in mine.values()) == stats[key]
            # Each agent's own numbers, in its usage too (an extension the SDK keeps).
            for a, x in zip(agents, rs):
                ext, m = x.usage.model_extra["tokendance"], mine[a]
                assert m["kv_dense_bytes"] > m["kv_held_bytes"] > 0 and m["kv_ratio"] > 1
                assert 0 < ext.pop("shared_tokens") < x.usage.prompt_tokens
                assert ext == {k: m[k] for k in ("recomputed_tokens", "kv_dense_bytes", "kv_held_bytes")}
                assert m["reused_tokens"] == x.usage.prompt_tokens_details.cached_tokens
            shared += stats["kv_shared_bytes"]
        after = metrics(await http.get(engine_live.url + "/metrics"))
    assert all(x.usage.prompt_tokens_details.cached_tokens > 0 for x in rs)  # round 2 reused
    await c.close()
    grew = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("tokendance_kv_bytes_total")}
    assert grew['tokendance_kv_bytes_total{kind="shared"}'] == shared
    assert grew['tokendance_kv_bytes_total{kind="dense"}'] > grew['tokendance_kv_bytes_total{kind="held"}'] > 0
    assert after["tokendance_engine_kv_dense_bytes"] == 0  # nothing runs now
    assert after["tokendance_engine_kv_held_bytes"] > 0  # the round's bases stay cached


def metrics(resp: httpx.Response) -> dict[str, float]:
    """/metrics as {series: value}."""
    assert resp.status_code == 200
    rows = (line.rsplit(" ", 1) for line in resp.text.splitlines() if line and not line.startswith("#"))
    return {k: float(v) for k, v in rows}


async def test_a_request_the_engine_fails_to_add_fails_alone(engine_live, model, monkeypatch):
    engine = engine_live.backend.engine
    add = engine.add

    def add_or_fail(rid, prompt, sampling, *args, **kw):
        if sampling.seed == 7:
            raise RuntimeError("boom")
        return add(rid, prompt, sampling, *args, **kw)

    monkeypatch.setattr(engine, "add", add_or_fail)
    c = openai.AsyncOpenAI(base_url=engine_live.url + "/v1", api_key="sk-test", max_retries=0, timeout=20)
    kw = dict(model=model, messages=user("hi"), max_tokens=3, temperature=0)
    bad, good = await asyncio.gather(c.chat.completions.create(**kw, seed=7),
                                     c.chat.completions.create(**kw), return_exceptions=True)
    assert isinstance(bad, openai.InternalServerError)
    assert bad.body["message"] == "engine error: RuntimeError: boom"  # said once, with its kind
    assert good.choices[0].finish_reason == "length"
    assert engine_live.backend.core.thread.is_alive() and not engine.seqs
    await c.close()


async def test_disconnect_mid_stream_frees_the_engines_kv(engine_live, model):
    engine = engine_live.backend.engine
    await asyncio.sleep(0.05)
    free = engine.pool.num_free
    body = {"model": model, "messages": user("Go on."), "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", engine_live.url + "/v1/chat/completions", json=body) as resp:
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: {")
                if n == 4:
                    break
    end = time.monotonic() + 5
    while engine.pool.num_free != free or engine.has_work():
        assert time.monotonic() < end, "the engine kept the aborted sequence"
        await asyncio.sleep(0.02)


async def test_an_agents_next_turn_resumes_its_parked_kv(engine_live, model):
    """Session and agent travel from the SDK to the engine: each agent's KV is parked when
    its turn ends, and its next turn (the same chat plus its answer and a new question)
    restores that prefix instead of prefilling it, reported as cached tokens."""
    engine = engine_live.backend.engine
    c = openai.AsyncOpenAI(base_url=engine_live.url + "/v1", api_key="sk-test", max_retries=0)
    chats = {a: user(f"I am {a}. Name a colour.") for a in ("p", "q")}

    async def turn(a: str, r: int) -> openai.types.chat.ChatCompletion:
        return await c.chat.completions.create(
            model=model, messages=chats[a], max_tokens=4, temperature=0,
            extra_body={"tokendance": {"session": "resume", "agent": a, "round": r, "mode": "collective"}})

    async with httpx.AsyncClient() as http:
        for r in (1, 2):
            opened = await http.post(engine_live.url + f"/v1/tokendance/sessions/resume/rounds/{r}",
                                     json={"agents": list(chats)})
            assert opened.status_code == 200
    first = await asyncio.gather(*[turn(a, 1) for a in chats])
    for a, resp in zip(chats, first):
        chats[a] = chats[a] + [{"role": "assistant", "content": resp.choices[0].message.content},
                               *user("And another one?")]
    restored = engine.idle.restored
    second = await asyncio.gather(*[turn(a, 2) for a in chats])
    assert engine.idle.restored > restored
    assert all(x.usage.prompt_tokens_details.cached_tokens >= 16 for x in second)
    await c.close()
    async with httpx.AsyncClient() as http:
        text = (await http.get(engine_live.url + "/metrics")).text
    # Both agents parked again after their second turn (earlier tests' agents may be
    # there too); /metrics shows the host tier.
    assert f"tokendance_engine_parked_agents {len(engine.idle.tier)}" in text
    assert {k.split("\0")[1] for k in engine.idle.parked} >= {"resume/p", "resume/q"}
    assert f"tokendance_engine_host_tier_bytes {engine.idle.bytes:g}" in text and engine.idle.bytes > 0
    assert f"tokendance_engine_restored_tokens_total {engine.idle.restored:g}" in text
    assert "# TYPE tokendance_engine_restored_tokens_total counter" in text
    assert "tokendance_engine_eager_decode_steps_total 0" in text  # the CPU has no graphs
    assert f"tokendance_engine_preemptions_total {engine.scheduler.preemptions:g}" in text


def test_prefix_cache_is_per_api_key(engine_live, model):
    def cached(key: str) -> int:
        c = engine_live.client(key)
        r = c.completions.create(model=model, prompt=list(range(1000, 1080)), max_tokens=1,
                                 extra_body={"tokendance": {"mode": "prefix"}})
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached("sk-one"), cached("sk-two"), cached("sk-one"), cached("sk-two")] == [0, 0, 64, 64]


def test_a_cache_salt_namespaces_the_keys_cache(engine_live, model):
    c = engine_live.client("sk-salty")

    def cached(salt: str | None) -> int:
        r = c.completions.create(model=model, prompt=list(range(2000, 2080)), max_tokens=1,
                                 extra_body={"tokendance": {"mode": "prefix"},
                                             **({"cache_salt": salt} if salt is not None else {})})
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(None), cached("a"), cached("b"), cached("a"), cached(None)] == [0, 0, 0, 64, 64]
    with pytest.raises(openai.BadRequestError) as err:
        cached("")  # vLLM's rule: a salt, if given, is not empty
    assert err.value.param == "cache_salt"


# Penalties and logit_bias: they arrive (the answer equals the engine's own with them) and
# change the answer.

PENALIZED = [7, 8, 9]  # the tiny model's greedy answer to it repeats a token
STORY = user("Tell me a story about a cat.")


@pytest.fixture(scope="module")
def direct(tiny_llama) -> Engine:
    """The same weights in an engine of our own (the server's runs in its thread)."""
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)


def expected(direct: Engine, prompt: list[int], **kw: Any) -> str:
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw)
    return direct.generate([prompt], p)[0][1]


def sdk_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """repetition_penalty is vLLM's: the SDK sends it in extra_body; logit_bias keys are strings."""
    out = {k: v for k, v in kw.items() if k != "repetition_penalty"}
    if "logit_bias" in out:
        out["logit_bias"] = {str(t): b for t, b in out["logit_bias"].items()}
    extra = {k: v for k, v in kw.items() if k == "repetition_penalty"}
    return {**out, "extra_body": {"ignore_eos": True, **extra}}


CASES = [dict(frequency_penalty=1.0), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
         dict(logit_bias={1234: 100.0}), dict(presence_penalty=-0.5, repetition_penalty=0.5)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "+".join(kw))
def test_completions_take_the_parameters(client, model, direct, kw):
    want = expected(direct, PENALIZED, **kw)
    assert want != expected(direct, PENALIZED)
    r = client.completions.create(model=model, prompt=PENALIZED, max_tokens=24, temperature=0,
                                  **sdk_kwargs(kw))
    assert r.choices[0].text == want


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "+".join(kw))
def test_chat_takes_the_parameters(client, model, direct, kw):
    prompt = direct.encode(render_chat(direct.tokenizer, STORY))
    want = expected(direct, prompt, **kw)
    assert want != expected(direct, prompt)
    r = client.chat.completions.create(model=model, messages=STORY, max_tokens=24, temperature=0,
                                       **sdk_kwargs(kw))
    assert r.choices[0].message.content == want


def test_logit_bias_forces_a_token_in_a_stream(client, model, direct):
    piece = direct.tokenizer.decode([1234])
    chunks = client.completions.create(model=model, prompt=PENALIZED, max_tokens=5, temperature=0,
                                       stream=True, logit_bias={"1234": 100}, logprobs=1)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == [piece] * 5


@pytest.mark.parametrize("kw,param", [
    (dict(logit_bias={"49152": 5}), "logit_bias"), (dict(logit_bias={"12": 101}), "logit_bias"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
])
def test_bad_values_are_a_400_naming_the_field(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=STORY, max_tokens=2, **kw)
    assert err.value.param == param


def test_a_shared_segment_leaves_the_prompts_tokens_as_the_text_has_them(client, model, direct):
    # A shared block right after "Ada: ": the model still reads the prompt's own tokens
    # (" I" with its space), so `full` answers exactly as an engine given the text.
    # Tokenized apart, the segment would start at "I" and the prompt read a lone " ".
    block = "I think the sky is blue today."
    content = f"Ada: {SEP}{block}{SEP}\nWhat do you say?"
    r = client.chat.completions.create(
        model=model, messages=user(content), max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "tokendance": {"separators": True, "mode": "full"}})
    assert r.usage.model_extra["tokendance"]["shared_tokens"] > 0
    text = render_chat(direct.tokenizer, user(content.replace(SEP, "")))
    head, tail = text.split(block)
    apart = direct.encode(head) + direct.encode(block) + direct.encode(tail)
    assert len(apart) != len(direct.encode(text))  # the case this test is about
    assert r.usage.prompt_tokens == len(direct.encode(text))
    want = direct.generate([direct.encode(text)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert r.choices[0].message.content == want[0][1]


def test_vllms_sampling_extras_arrive(client, model, direct):
    """min_tokens, include_stop_str_in_output and min_p (vLLM's, in extra_body) give the
    engine's own answer with them, whole and streamed."""
    toks = direct.generate([PENALIZED], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0][0]
    first = next(i for i, t in enumerate(toks) if t in toks[i + 1:])  # a token the answer repeats
    stop = direct.tokenizer.decode([toks[first]]).strip()
    kw = dict(stop=[stop], min_tokens=first + 1, include_stop_str_in_output=True, min_p=0.5)
    want = expected(direct, PENALIZED, **kw)
    cut = expected(direct, PENALIZED, stop=[stop])
    assert want.endswith(stop) and len(want) > len(cut) + len(stop)  # past the first stop, kept
    body = {"ignore_eos": True, **{k: v for k, v in kw.items() if k != "stop"}}
    r = client.completions.create(model=model, prompt=PENALIZED, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body=body)
    chunks = client.completions.create(model=model, prompt=PENALIZED, max_tokens=24, temperature=0, stop=[stop],
                                       extra_body=body, stream=True)
    assert r.choices[0].text == want == "".join(c.choices[0].text for c in chunks)


@pytest.mark.parametrize("mode", ["kvcomm", "kvcmas"])
async def test_anchored_rounds_measure_anchors_then_read_them(engine_live, model, mode):
    """kvcomm (kvcmas) through the proxy: an agent's first round is prefilled exactly
    (nothing reused), and measures its anchors; its next round reads another block at
    the same place as base + offset (reused, not recomputed), each agent's cache its own."""
    c = openai.AsyncOpenAI(base_url=engine_live.url + "/v1", api_key="sk-test", max_retries=0)
    agents = ["a", "b", "c"]
    blocks = [" ".join(f"fact{i}" for i in range(40)), " ".join(f"rule{i}" for i in range(20))]

    def turn(a: str, r: int):
        return marked(c, model, f"I am {a}.{SEP}{blocks[r - 1]}{SEP}Answer briefly.", mode, a, r, mode)

    async with httpx.AsyncClient() as http:
        before = metrics(await http.get(engine_live.url + "/metrics"))
        opened = await http.post(engine_live.url + f"/v1/tokendance/sessions/{mode}/rounds/1", json={"agents": agents})
        assert opened.status_code == 200
        for r in (1, 2):
            rs = await asyncio.gather(*[turn(a, r) for a in agents])
            stats = (await http.get(engine_live.url + f"/v1/tokendance/sessions/{mode}/rounds/{r}")).json()
            assert stats["shared_tokens"] > 0 and stats["recomputed_tokens"] == 0
            for x in rs:
                ext = x.usage.model_extra["tokendance"]
                assert ext["kv_held_bytes"] == ext["kv_dense_bytes"]  # corrected K/V is each agent's own
                cached = x.usage.prompt_tokens_details.cached_tokens or 0
                assert (cached > 0) == (r == 2), (r, cached)
        seen = metrics(await http.get(engine_live.url + "/metrics"))
    grew = {k: seen[k] - before.get(k, 0) for k in seen}
    assert grew[f"tokendance_engine_{mode}_measured_total"] == grew[f"tokendance_engine_{mode}_predicted_total"] == 3
    other = "kvcmas" if mode == "kvcomm" else "kvcomm"
    assert grew[f"tokendance_engine_{other}_measured_total"] == grew[f"tokendance_engine_{other}_predicted_total"] == 0
    assert seen["tokendance_engine_anchor_bytes"] > 0
    await c.close()
