"""The proxy over a remote engine (`tokendance serve --engine URL` in front of `tokendance
engine`): the same answers as in-process, refusals before the barrier, aborts that free
the engine's KV, and /health when the engine stopped. An engine the proxy cannot reach:
test_unavailable.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tokendance.backend import wire
from tokendance.backend.api import BackendError, InvalidRequest, Prepared, Request, SamplingParams, Segment
from tokendance.backend.auth import Keys
from tokendance.backend.endpoint import Endpoint, engine_info
from tokendance.backend.remote import RemoteBackend
from tokendance.backend.service import EngineBackend
from tokendance.examples import cli
from tokendance.proxy.segment import SEP


@dataclass
class Remote:
    url: str
    backend: EngineBackend  # the engine's side
    runner: web.AppRunner


async def _serve(tiny_llama, keys: Keys | None = None, **kw: Any) -> Remote:
    be = EngineBackend.load(str(tiny_llama), dtype="float32", **kw)
    runner = web.AppRunner(Endpoint(be, engine_info(be), keys).app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return Remote(f"http://127.0.0.1:{runner.addresses[0][1]}", be, runner)


@contextlib.asynccontextmanager
async def served(tiny_llama, **kw: Any) -> AsyncIterator[Remote]:
    """`_serve`, stopped after."""
    r = await _serve(tiny_llama, **kw)
    try:
        yield r
    finally:
        await r.runner.cleanup()
        await r.backend.close()


@pytest.fixture
async def remote(tiny_llama) -> AsyncIterator[Remote]:
    async with served(tiny_llama, offload_bytes=0) as r:
        yield r


@pytest.fixture
async def proxy(remote, start) -> Any:
    return await start(await RemoteBackend.connect(remote.url, "collective"), barrier_timeout=10.0)


def _client(server: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def test_answers_equal_the_in_process_engines(tiny_llama, proxy, start):
    local = await start(EngineBackend.load(str(tiny_llama), dtype="float32", offload_bytes=0))
    name = proxy.proxy.backend.info.name
    kw = dict(model=name, messages=user("Tell me a story about a bridge."), max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)
    a, b = [await _client(s).chat.completions.create(**kw) for s in (proxy, local)]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].logprobs.model_dump() == b.choices[0].logprobs.model_dump()
    assert a.usage.model_dump() == b.usage.model_dump()
    sampled = dict(model=name, prompt="The market opens", max_tokens=6, temperature=1.0, seed=7, n=2)
    a, b = [await _client(s).completions.create(**sampled) for s in (proxy, local)]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # The prompt's logprobs come over the wire with the first token.
    echoed = dict(model=name, prompt="The market opens", max_tokens=2, temperature=0, logprobs=2, echo=True)
    a, b = [await _client(s).completions.create(**echoed) for s in (proxy, local)]
    assert a.choices[0].logprobs.model_dump() == b.choices[0].logprobs.model_dump()
    assert a.choices[0].logprobs.token_logprobs[0] is None and len(a.choices[0].logprobs.tokens) > 2
    chunks = [c async for c in await _client(proxy).chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    first = await _client(local).chat.completions.create(**kw)
    assert text == first.choices[0].message.content and chunks[-1].usage.completion_tokens == 8
    # A structured output's spec travels with the request; the engine keeps to it.
    so = {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}
    a, b = [await _client(s).chat.completions.create(**kw, extra_body=so) for s in (proxy, local)]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", a.choices[0].message.content)
    # So does a named tool's schema; the proxy reads the call out.
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["x"], "properties": {"x": {"enum": ["left", "right"]}}}}}
    forced = dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}})
    a, b = [await _client(s).chat.completions.create(**kw, **forced) for s in (proxy, local)]
    assert a.choices[0].message.tool_calls[0].function == b.choices[0].message.tool_calls[0].function
    assert json.loads(a.choices[0].message.tool_calls[0].function.arguments)["x"] in ("left", "right")


async def test_beam_search_over_the_wire_equals_the_in_process_engines(tiny_llama, proxy, start):
    """Its steps' alternatives come with their token ids, and the engine's end tokens with /info."""
    local = await start(EngineBackend.load(str(tiny_llama), dtype="float32", offload_bytes=0))
    assert proxy.proxy.backend.info.eos == local.proxy.backend.info.eos != ()
    kw = dict(model=proxy.proxy.backend.info.name, prompt="The market opens", max_tokens=4, n=3,
              extra_body={"use_beam_search": True})
    a, b = [await _client(s).completions.create(**kw) for s in (proxy, local)]
    assert [(c.text, c.finish_reason) for c in a.choices] == [(c.text, c.finish_reason) for c in b.choices]
    assert len({c.text for c in a.choices}) == 3


async def test_embeddings_equal_the_in_process_engines(tiny_llama, proxy, start):
    local = await start(EngineBackend.load(str(tiny_llama), dtype="float32", offload_bytes=0))
    kw = dict(model=proxy.proxy.backend.info.name, input=["The market opens", "at dawn"], encoding_format="float")
    a, b = [await _client(s).embeddings.create(**kw) for s in (proxy, local)]
    assert a.usage == b.usage and [d.index for d in a.data] == [0, 1]
    for x, y in zip(a.data, b.data):
        assert max(abs(p - q) for p, q in zip(x.embedding, y.embedding)) < 1e-5


async def test_a_round_reuses_its_shared_block_on_the_engine(proxy):
    c = _client(proxy)
    agents = ["a", "b", "c"]
    block = " ".join(f"fact{i}" for i in range(40))

    async def turn(a: str) -> Any:
        return await c.chat.completions.create(
            model=proxy.proxy.backend.info.name, messages=user(f"I am {a}.{SEP}{block}{SEP}Answer."),
            max_tokens=3, temperature=0,
            extra_body={"tokendance": {"session": "far", "agent": a, "round": 1, "separators": True}})

    async with httpx.AsyncClient() as http:
        await http.post(proxy.url + "/v1/tokendance/sessions/far/rounds/1", json={"agents": agents})
        rs = await asyncio.gather(*[turn(a) for a in agents])
        stats = (await http.get(proxy.url + "/v1/tokendance/sessions/far/rounds/1")).json()
    assert (stats["groups"], stats["requests"]) == (1, 3)
    assert stats["shared_tokens"] > 0 and stats["reused_tokens"] > 0
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in rs)


async def test_refusals_come_from_the_proxy_before_the_engine_sees_them(proxy, remote):
    c = _client(proxy)
    name = proxy.proxy.backend.info.name
    n = proxy.proxy.backend.info.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model=name, prompt=[5] * (n + 1), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=name, messages=user("hi"), max_tokens=2,
                                        logit_bias={"999999": 1})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:  # the proxy compiles the spec with the engine's tokenizer
        await c.chat.completions.create(model=name, messages=user("hi"), max_tokens=2,
                                        extra_body={"structured_outputs": {"regex": "(a"}})
    assert e.value.body["param"] == "structured_outputs.regex"
    with pytest.raises(openai.BadRequestError) as e:  # the engine serves first come, first served
        await c.chat.completions.create(model=name, messages=user("hi"), max_tokens=2, extra_body={"priority": 1})
    assert (e.value.body["param"], e.value.body["code"]) == ("priority", "unsupported")
    assert remote.backend.engine.seqs == {} and not remote.backend.core.streams


async def test_a_request_the_engine_refuses_fails_alone(proxy):
    be: RemoteBackend = proxy.proxy.backend
    good = Request("ok", [Segment("hello there")], SamplingParams(max_tokens=3, temperature=0), mode="full")
    bad = Request("bad", [], SamplingParams(max_tokens=3), mode="sideways", prompt_token_ids=[5, 6])
    ok, refused = be.generate([be.prepare(good), Prepared(bad, 2, bad)])  # the proxy would refuse it
    with pytest.raises(InvalidRequest, match="unknown mode"):
        [d async for d in refused]
    deltas = [d async for d in ok]
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 3


async def test_a_client_that_leaves_frees_the_engines_kv(proxy, remote, until):
    eng = remote.backend.engine
    free = eng.pool.num_free
    stream = await _client(proxy).chat.completions.create(
        model=proxy.proxy.backend.info.name, messages=user("Go on forever."), max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert eng.seqs
    await stream.close()
    await until(lambda: not eng.seqs and eng.pool.num_free == free, timeout=10)


async def test_metrics_show_the_engines_gauges(proxy, remote):
    blocks = remote.backend.engine.cache.num_blocks
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        for _ in range(100):
            text = (await http.get("/metrics")).text
            if f"tokendance_engine_kv_blocks {blocks}" in text:
                break
            await asyncio.sleep(0.05)
    assert f"tokendance_engine_kv_blocks {blocks}" in text


async def test_health_says_when_the_engine_stopped(proxy, remote):
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/completions", json={"model": proxy.proxy.backend.info.name, "prompt": "hi",
                                                    "max_tokens": 1})
        assert r.status_code == 200  # the engine's thread runs
        await remote.backend.core.close()
        for _ in range(100):  # the proxy polls the engine every 2 s
            health = await http.get("/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.05)
    assert health.json()["error"]["message"] == f"the engine at {remote.url}: the engine has stopped"


async def test_connect_names_what_is_wrong():
    with pytest.raises(BackendError, match="no engine at http://127.0.0.1:9"):
        await RemoteBackend.connect("http://127.0.0.1:9", timeout=2)


async def test_an_engine_with_a_key_answers_only_proxies_that_carry_it(tiny_llama, start):
    async with served(tiny_llama, keys=Keys(["ek-1", "ek-2"]), offload_bytes=0) as r:
        with pytest.raises(BackendError, match="requires an API key: give it with --engine-api-key"):
            await RemoteBackend.connect(r.url)
        with pytest.raises(BackendError, match="refused the API key given"):
            await RemoteBackend.connect(r.url, api_key="ek-3")
        async with httpx.AsyncClient(base_url=r.url) as http:
            assert (await http.get("/health")).status_code == 200  # open, as the proxy's is
            no = await http.post(wire.PREFIX + "/abort", json={"ids": ["x"]})
            assert no.status_code == 401 and "requires an API key" in no.json()["message"]
        server = await start(await RemoteBackend.connect(r.url, api_key="ek-2"), barrier_timeout=10.0)
        got = await _client(server).chat.completions.create(
            model=server.proxy.backend.info.name, messages=user("hello there"), max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4
        blocks = r.backend.engine.cache.num_blocks
        async with httpx.AsyncClient(base_url=server.url) as http:  # the gauges come with the key too
            for _ in range(100):
                if f"tokendance_engine_kv_blocks {blocks}" in (await http.get("/metrics")).text:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("no gauges")


@pytest.mark.parametrize("argv,env,message", [
    (["serve", "--engine-api-key", "k"], None, "--engine-api-key is sent to the --engine or --vllm servers"),
    (["serve", "--engine", "http://127.0.0.1:9", "--engine-api-key", "a b"], None, "--engine-api-key: a key is"),
    (["serve", "--engine", "http://127.0.0.1:9"], " ", "$TOKENDANCE_ENGINE_API_KEY: a key is"),
    (["engine", "--api-key", ""], None, "tokendance engine: --api-key: a key is a non-empty string"),
])
def test_engine_keys_fail_in_one_line(monkeypatch, capsys, argv, env, message):
    monkeypatch.setattr(EngineBackend, "load", classmethod(lambda cls, **kw: pytest.fail("loaded")))
    if env is not None:
        monkeypatch.setenv("TOKENDANCE_ENGINE_API_KEY", env)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_serve_with_an_engine_refuses_engine_flags(capsys):
    assert cli.main(["serve", "--engine", "http://127.0.0.1:9", "--bases", "reader"]) == 1
    assert capsys.readouterr().err.strip() == ("tokendance serve: --bases set the engine: with --engine, "
                                               "give them to `tokendance engine`")
    assert cli.main(["serve", "--engine", "http://127.0.0.1:9"]) == 1
    assert "no engine at http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "tokendance engine: --port must lie in 0..65535, got 70000"),
    (["--offload-gib", "-1"], "tokendance engine: --offload-gib must be a finite number, not negative"),
    (["--drain-timeout", "nan"], "tokendance engine: --drain-timeout must be a number, not negative"),
    (["/m/a", "--model", "/m/b"], "tokendance engine: MODEL /m/a and --model /m/b name two models: give one"),
])
def test_engine_flags_fail_in_one_line_before_loading_the_model(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(EngineBackend, "load", classmethod(lambda cls, **kw: pytest.fail("loaded")))
    assert cli.main(["engine", *argv]) == 1
    assert capsys.readouterr().err.strip() == message


def test_the_engine_loads_the_model_given_as_vllm_serve_takes_it(monkeypatch, capsys):
    def load(cls, **kw):
        raise ValueError(f"would load {kw['model']}")

    monkeypatch.setattr(EngineBackend, "load", classmethod(load))
    assert cli.main(["engine", "/m/a"]) == 1
    assert capsys.readouterr().err.strip() == "tokendance engine: would load /m/a"


def test_the_engine_key_goes_to_remote_engines_only(monkeypatch):
    from tokendance.backend import endpoint
    from tokendance.backend.remote import RemoteBackend
    from tokendance.proxy import serve

    parser = cli.Parser(prog="tokendance")
    subs = parser.add_subparsers(dest="command")
    serve.add_parser(subs)
    endpoint.add_parser(subs)
    monkeypatch.setenv("TOKENDANCE_ENGINE_API_KEY", "ek-env")
    assert serve.engine_key(parser.parse_args(["serve"])) is None  # in-process: nobody to send it to
    assert serve.engine_key(parser.parse_args(["serve", "--engine", "http://e"])) == "ek-env"
    flag = parser.parse_args(["serve", "--vllm", "http://v", "--engine-api-key", "ek-flag"])
    assert serve.engine_key(flag) == "ek-flag"
    sent = {}

    async def connect(url, mode="collective", timeout=10.0, api_key=None, trust_remote_code=False):
        sent[url] = api_key
        raise BackendError("stop here")

    monkeypatch.setattr(RemoteBackend, "connect", staticmethod(connect))
    with pytest.raises(ValueError, match="stop here"):
        serve.load_backend(parser.parse_args(["serve", "--engine", "http://e"]))
    assert sent == {"http://e": "ek-env"}
    # the engine takes its keys from the same variable, or from --api-key
    kept = []
    monkeypatch.setattr(EngineBackend, "load", classmethod(lambda cls, **kw: type("B", (), {"engine": None})()))
    monkeypatch.setattr(endpoint, "engine_info", lambda engine: wire.Info(name="m", max_model_len=8,
                                                                          kv_bytes_per_token=1, vocab_size=8,
                                                                          tokenizer={}))
    monkeypatch.setattr(endpoint, "serve", lambda ep, *a: kept.append(ep.keys) or asyncio.sleep(0))
    frozen = []
    monkeypatch.setattr(endpoint.heap, "frozen", lambda: frozen.append(len(kept)) or contextlib.nullcontext())
    assert endpoint.main(parser.parse_args(["engine"])) == 0
    assert frozen == [0]  # then it served
    assert endpoint.main(parser.parse_args(["engine", "--api-key", "a", "--api-key", "b"])) == 0
    assert kept[0].accept({"Authorization": "Bearer ek-env"}) and not kept[0].accept({})
    assert kept[1].accept({"Authorization": "Bearer b"}) and not kept[1].accept({"Authorization": "Bearer ek-env"})


async def test_a_remote_engine_tells_the_proxy_its_default_sampling(tiny_llama):
    async with served(tiny_llama, offload_bytes=0, override_generation_config={"temperature": 0.4, "top_k": 3}) as r:
        be = await RemoteBackend.connect(r.url)
        assert be.info.sampling == {"temperature": 0.4, "top_k": 3} and isinstance(be.info.sampling["top_k"], int)
        await be.close()


async def test_a_remote_engine_that_schedules_by_priority_takes_one(tiny_llama, start):
    async with served(tiny_llama, offload_bytes=0, scheduling_policy="priority") as r:
        be = await RemoteBackend.connect(r.url)
        assert be.info.priority
        server = await start(be)
        engine, seen = r.backend.engine, []
        add = engine.add
        engine.add = lambda rid, prompt, sampling, *a, **kw: (seen.append(sampling.priority),
                                                              add(rid, prompt, sampling, *a, **kw))
        answer = await _client(server).chat.completions.create(
            model=be.info.name, messages=user("hi"), max_tokens=2, extra_body={"priority": -4})
        assert answer.choices[0].finish_reason == "length" and seen == [-4]
