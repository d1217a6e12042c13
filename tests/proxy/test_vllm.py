"""The proxy over a vLLM server (`tokendance serve --vllm URL`), against a fake server that
speaks vLLM's streamed /v1/completions (tests/proxy/fake_vllm.py): token ids go out,
deltas and usage come back, `full` and `prefix` map to cache salts, its refusals are
400s, and a server that cannot be reached is a 503. Embeddings and scores through it:
test_vllm_scores.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tokendance.backend.api import BackendError
from tokendance.backend.vllm import VLLMBackend
from tokendance.examples import cli

from .fake_vllm import FakeVLLM, client, served, user


async def test_a_chat_goes_to_vllm_as_token_ids(proxy, vllm, tiny_llama):
    r = await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi there."),
                                                     max_tokens=3, temperature=0, seed=4)
    assert r.choices[0].message.content == " w0 w1 w2" and r.choices[0].finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(tok.apply_chat_template(user("Hi there."), tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    body = vllm.bodies[-1]
    assert body["prompt"] == ids and body["return_token_ids"] and body["stream"]
    assert (body["temperature"], body["seed"], body["max_tokens"]) == (0, 4, 3)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3)
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    stopped = await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=2,
                                                           stop=["stop"])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == "stop"


async def test_vllms_sampling_extras_reach_it(proxy, vllm):
    extra = {"min_p": 0.05, "min_tokens": 2, "include_stop_str_in_output": True, "skip_special_tokens": False,
             "allowed_token_ids": [3, 4, 5], "bad_words": ["w1 w2"],
             "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3},
             "priority": -2}  # vLLM refuses it unless started with --scheduling-policy priority
    await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=3,
                                                 stop=["w2"], extra_body=extra)
    body = vllm.bodies[-1]
    assert {k: body[k] for k in extra} == extra and body["stop"] == ["w2"]


async def test_a_thinking_budget_reaches_vllm_from_a_chat_and_a_message(vllm, start):
    """With a reasoning parser the proxy takes the budget (a message's budget_tokens too)
    and the vLLM server, with its own reasoning config, enforces it."""
    server = await start(await VLLMBackend.connect(vllm.url), reasoning="qwen3")
    await client(server).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=2,
                                                   extra_body={"thinking_token_budget": 7})
    assert vllm.bodies[-1]["thinking_token_budget"] == 7
    async with httpx.AsyncClient() as http:
        r = await http.post(server.url + "/v1/messages", json={
            "model": "fake-vllm", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}],
            "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 200 and vllm.bodies[-1]["thinking_token_budget"] == 1024


@pytest.mark.parametrize("kw,sent", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
     {"json": {"type": "integer"}}),
    ({"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, {"choice": ["a", "b"]}),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}}, {"regex": "[0-9]+"}),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x"'}}}, {"grammar": 'root ::= "x"'}),
    ({"extra_body": {"structured_outputs": {"json": {"type": "integer"}, "disable_any_whitespace": True}}},
     {"json": {"type": "integer"}, "disable_any_whitespace": True}),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     {"json": {"type": "object"}, "disable_any_whitespace": True}),
    ({"extra_body": {"structured_outputs": {"structural_tag": {"format": {"type": "const_string", "value": "x"}}}}},
     {"structural_tag": '{"type":"structural_tag","format":{"type":"const_string","value":"x"}}'}),
], ids=["json_object", "json_schema", "choice", "regex", "grammar", "compact json", "named tool", "structural tag"])
async def test_structured_outputs_go_to_vllm_as_its_structured_outputs(proxy, vllm, kw, sent):
    await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=2, **kw)
    assert vllm.bodies[-1]["structured_outputs"] == sent


async def test_a_spec_that_does_not_compile_never_reaches_vllm(proxy, vllm):
    before = len(vllm.bodies)
    with pytest.raises(openai.BadRequestError) as e:
        await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=2,
                                                     extra_body={"structured_outputs": {"regex": "[0-"}})
    assert e.value.body["param"] == "structured_outputs.regex" and len(vllm.bodies) == before


async def test_full_and_prefix_map_to_cache_salts(proxy, vllm):
    async def salt(mode: str, key: str) -> str:
        await client(proxy, key).completions.create(model="fake-vllm", prompt="a b", max_tokens=1,
                                                     extra_body={"tokendance": {"mode": mode}})
        return vllm.bodies[-1]["cache_salt"]

    assert await salt("prefix", "sk-a") == await salt("prefix", "sk-a") != await salt("prefix", "sk-b")
    assert await salt("full", "sk-a") != await salt("full", "sk-a")
    with pytest.raises(openai.BadRequestError) as e:
        await salt("collective", "sk-a")
    assert e.value.body["param"] == "mode" and "TokenDance engine" in e.value.body["message"]


async def test_streams_and_logprobs_come_back(proxy, tiny_llama):
    """The logprobs' tokens come by id and are written as the engine writes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    kw = dict(model="fake-vllm", messages=user("Go."), max_tokens=4, logprobs=True, top_logprobs=2)
    chunks = [c async for c in await client(proxy).chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert text == " w0 w1 w2 w3" and [t.token for t in lps] == [tok.decode([100 + i]) for i in range(4)]
    assert [x.token for x in lps[0].top_logprobs] == [tok.decode([100]), tok.decode([7])]
    assert chunks[-1].usage.completion_tokens == 4
    named = await client(proxy).chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    assert [t.token for t in named.choices[0].logprobs.content] == [f"token_id:{100 + i}" for i in range(4)]
    # logprob_token_ids: the asked tokens alone, in their order, as the engine lists them
    labels = await client(proxy).chat.completions.create(**kw, extra_body={"logprob_token_ids": [9, 3, 9]})
    for t in labels.choices[0].logprobs.content:
        assert [(x.token, x.logprob) for x in t.top_logprobs] == [(tok.decode([9]), -1.009), (tok.decode([3]), -1.003)]


async def test_a_beam_search_steps_through_vllm_one_token_at_a_time(proxy, vllm, tiny_llama):
    """Each step a one-token request per beam, asking the 2n likeliest by id: the fake's
    likeliest is token 100 at every step."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok.eos_token_id in proxy.proxy.backend.info.eos
    r = await client(proxy).completions.create(model="fake-vllm", prompt=[1, 2, 3], max_tokens=3,
                                               extra_body={"use_beam_search": True})
    assert r.choices[0].text == tok.decode([100] * 3) and r.choices[0].finish_reason == "length"
    steps = vllm.bodies[-3:]
    assert [b["prompt"] for b in steps] == [[1, 2, 3], [1, 2, 3, 100], [1, 2, 3, 100, 100]]
    assert all((b["max_tokens"], b["logprobs"]) == (1, 2) for b in steps)


async def test_what_vllm_refuses_is_a_400(proxy):
    with pytest.raises(openai.BadRequestError) as e:
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=500)
    assert "max_tokens is too large" in e.value.body["message"]


async def test_the_proxy_samples_with_the_generation_config_vllm_would(vllm, start):
    """The proxy sends every field, so it applies what the server's --generation-config
    and --override-generation-config would (the model folder's, here overridden)."""
    be = await VLLMBackend.connect(vllm.url, generation=("vllm", {"temperature": 0.25, "top_k": 7}))
    assert be.info.sampling == {"temperature": 0.25, "top_k": 7}
    proxy = await start(be)
    await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Hi."), max_tokens=2)
    assert (vllm.bodies[-1]["temperature"], vllm.bodies[-1]["top_k"]) == (0.25, 7)


async def test_echo_through_vllm_without_logprobs_only_and_no_prompt_logprobs(proxy, vllm):
    r = await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2, echo=True)
    assert r.choices[0].text == "a b w0 w1"
    with pytest.raises(openai.BadRequestError) as e:
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2, echo=True, logprobs=1)
    assert e.value.body["param"] == "prompt_logprobs" and "TokenDance engine" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2,
                                                extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


async def test_a_chat_without_a_length_asks_vllm_for_the_rest_of_the_context(proxy, vllm):
    with pytest.raises(openai.BadRequestError):  # the fake refuses more than 100
        await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Go."))
    body = vllm.bodies[-1]
    assert body["max_tokens"] == 4096 - len(body["prompt"])
    with pytest.raises(openai.BadRequestError):
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=9000)
    assert vllm.bodies[-1]["max_tokens"] == 4096 - len(vllm.bodies[-1]["prompt"])  # never past the context


async def test_a_client_that_leaves_closes_its_vllm_call(proxy, vllm, until):
    stream = await client(proxy).chat.completions.create(model="fake-vllm", messages=user("Go."),
                                                          max_tokens=90, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    await until(lambda: vllm.cancelled == 1, timeout=10)


async def test_a_lost_server_is_a_503_and_health_says_so(proxy, vllm):
    await vllm.runner.cleanup()
    with pytest.raises(openai.InternalServerError) as e:
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "2"
    assert f"cannot reach the vLLM server at {vllm.url}" in e.value.body["message"]
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        r = await http.get("/health")
    assert r.status_code == 503 and "does not answer" in r.json()["error"]["message"]


@pytest.mark.parametrize("status, code", [(503, "backend_unavailable"), (500, "engine_error")])
async def test_a_server_that_cannot_serve_now_is_a_503_one_that_failed_a_500(proxy, vllm, status, code):
    vllm.status = status
    with pytest.raises(openai.InternalServerError) as e:
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2)
    assert e.value.status_code == status and e.value.body["code"] == code
    assert f"failed with {status}" in e.value.body["message"]


async def test_a_lost_server_is_found_again_once_its_health_answers(proxy, vllm, until, monkeypatch):
    from tokendance.backend import vllm as vllm_module

    monkeypatch.setattr(vllm_module, "POLL", 0.1)
    port = int(vllm.url.rsplit(":", 1)[1])
    await vllm.runner.cleanup()
    with pytest.raises(openai.InternalServerError):
        await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2)
    backend = proxy.proxy.backend
    assert backend.problem() is not None
    await served(vllm, port)  # back, and nobody calls it: its /health says so
    try:
        await until(lambda: backend.problem() is None, timeout=10)
        r = await client(proxy).completions.create(model="fake-vllm", prompt="a b", max_tokens=2)
        assert r.choices[0].text == " w0 w1"
    finally:
        await vllm.runner.cleanup()


async def test_several_servers_each_take_whole_sessions(tiny_llama, start):
    from tokendance.backend.fleet import Fleet

    fakes = [await served(FakeVLLM(str(tiny_llama))) for _ in range(2)]
    try:
        fleet = await Fleet.connect([f.url for f in fakes], lambda u: VLLMBackend.connect(u))
        server = await start(fleet)
        c = client(server)
        for rnd in (1, 2):
            for session in ("red", "blue"):
                await c.chat.completions.create(model="fake-vllm", messages=user(f"{session} {rnd}"), max_tokens=2,
                                                extra_body={"tokendance": {"session": session, "agent": "a"}})
        # each server saw one session's two rounds: its prefix cache holds that session
        assert sorted(len(f.bodies) for f in fakes) == [2, 2]
        assert all(len({b["cache_salt"] for b in f.bodies}) == 1 for f in fakes)
        prompts = [[AutoTokenizer.from_pretrained(tiny_llama).decode(b["prompt"]) for b in f.bodies] for f in fakes]
        assert all(len({p.split("user\n")[-1].split()[0] for p in ps}) == 1 for ps in prompts)
    finally:
        for f in fakes:
            await f.runner.cleanup()


async def test_a_server_with_an_api_key_gets_it(tiny_llama, start):
    fake = await served(FakeVLLM(str(tiny_llama), key="vk"))
    try:
        for key, match in ((None, "requires an API key: give it with --engine-api-key"), ("no", "refused the API key")):
            with pytest.raises(BackendError, match=match):
                await VLLMBackend.connect(fake.url, api_key=key)
        server = await start(await VLLMBackend.connect(fake.url, api_key="vk"))
        got = await client(server).chat.completions.create(model="fake-vllm", messages=user("hi"), max_tokens=3)
        assert got.choices[0].message.content == " w0 w1 w2" and len(fake.bodies) == 1
    finally:
        await fake.runner.cleanup()


@pytest.mark.parametrize("argv,message", [
    (["--vllm", "http://127.0.0.1:9", "--mode", "collective"], "--mode collective needs the TokenDance engine"),
    (["--vllm", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9"], "--engine and --vllm name two"),
    (["--vllm", "http://127.0.0.1:9", "--dtype", "float32"], "--dtype set our engine"),
    (["--engine", "http://127.0.0.1:9", "--tokenizer", "/x"], "--tokenizer set the engine"),
    (["--vllm", "http://127.0.0.1:9", "--hf-config-path", "/x"], "--hf-config-path set our engine"),
    (["--vllm", "http://127.0.0.1:9"], "no vLLM server at http://127.0.0.1:9"),
    (["--vllm", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9/"], "--vllm http://127.0.0.1:9 is given twice"),
    (["--vllm", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:10"], "no vLLM server at http://127.0.0.1:9"),
])
def test_serve_with_vllm_refuses_what_cannot_work(capsys, argv, message):
    assert cli.main(["serve", *argv]) == 1
    assert message in capsys.readouterr().err
