"""vLLM's request flags: --enable-log-requests and --max-log-len (a line for each request
the engine is given, chats, completions, embeddings, its prompt cut to the length asked;
none without the flag), --return-tokens-as-token-ids and --enable-force-include-usage."""

from __future__ import annotations

import openai
import pytest
import structlog

from tokendance.proxy import serve

from .test_serve import parse


def requests(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "request"]


async def test_each_request_is_logged_with_its_prompt_and_parameters(start):
    server = await start(log_requests=True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    with structlog.testing.capture_logs() as logs:
        answer = await client.chat.completions.create(model="fake-tiny", max_tokens=3, temperature=0.5, n=2,
                                                      messages=[{"role": "user", "content": "hello there"}])
        await client.completions.create(model="fake-tiny", prompt=[5, 6, 7], max_tokens=2)
    chat, chat2, text = requests(logs)
    assert chat["id"] == chat2["id"] == answer.id  # under the id the client got
    assert chat["kind"] == "chat" and "hello there" in chat["prompt"] and chat["prompt_tokens"] > 0
    assert chat["params"]["max_tokens"] == 3 and chat["params"]["temperature"] == 0.5
    assert "top_p" not in chat["params"]  # what the request leaves at its default is not listed
    assert chat2["request"] != chat["request"] and chat2["prompt"] == chat["prompt"]  # n = 2: two requests
    assert text["kind"] == "completion" and text["prompt_token_ids"] == [5, 6, 7] and text["prompt"] == ""


async def test_max_log_len_cuts_the_prompt_and_its_ids(start):
    server = await start(log_requests=True, max_log_len=4)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    with structlog.testing.capture_logs() as logs:
        await client.completions.create(model="fake-tiny", prompt="a prompt much longer than four", max_tokens=2)
        await client.completions.create(model="fake-tiny", prompt=[5, 6, 7, 8, 9, 10], max_tokens=2)
    text, ids = requests(logs)
    assert text["prompt"] == "a pr" and ids["prompt_token_ids"] == [5, 6, 7, 8]


async def test_nothing_is_logged_without_the_flag(start):
    server = await start()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    with structlog.testing.capture_logs() as logs:
        await client.completions.create(model="fake-tiny", prompt="hello", max_tokens=2)
    assert requests(logs) == []


def test_the_flags():
    c = serve.config(parse())
    assert (c.log_requests, c.max_log_len, c.as_ids, c.force_usage) == (False, None, False, False)
    c = serve.config(parse("--enable-log-requests", "--max-log-len", "100", "--return-tokens-as-token-ids",
                           "--enable-force-include-usage"))
    assert (c.log_requests, c.max_log_len, c.as_ids, c.force_usage) == (True, 100, True, True)
    assert not serve.config(parse("--enable-log-requests", "--disable-log-requests")).log_requests  # vLLM's old name
    assert not serve.config(parse("--no-enable-log-requests")).log_requests
    with pytest.raises(ValueError, match="--max-log-len must be at least 0, not -1"):
        serve.config(parse("--max-log-len", "-1"))


def test_embeddings_are_logged_and_tokens_named_by_id_by_default(engine_live, engine_model):
    """On the real engine: embeddings' prompts are logged too; --return-tokens-as-token-ids
    is the default a request's own return_tokens_as_token_ids overrides."""
    cfg, client = engine_live.server.proxy.config, engine_live.client()
    cfg.log_requests = cfg.as_ids = True
    try:
        with structlog.testing.capture_logs() as logs:
            client.embeddings.create(model=engine_model, input=["The river", "runs"])
        assert [(e["kind"], e["prompt"]) for e in requests(logs)] == [("pooling", "The river"), ("pooling", "runs")]
        assert all(e["id"].startswith("embd-") for e in requests(logs))
        kw = dict(model=engine_model, messages=[{"role": "user", "content": "Hi."}], max_tokens=2, temperature=0,
                  logprobs=True, top_logprobs=1)
        named = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
        ids = named.choices[0].model_extra["token_ids"]
        assert [t.token for t in named.choices[0].logprobs.content] == [f"token_id:{i}" for i in ids]
        plain = client.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.token.startswith("token_id:") for t in plain.choices[0].logprobs.content)
    finally:
        cfg.log_requests = cfg.as_ids = False


async def test_force_include_usage_ends_every_stream_with_its_usage(start):
    """vLLM's --enable-force-include-usage: as if every stream asked stream_options.include_usage."""
    for forced in (False, True):
        server = await start(force_usage=forced)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="fake-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True)]
        usage = [c.usage for c in chunks if c.usage is not None]
        assert (len(usage) == 1 and usage[0].prompt_tokens > 0) if forced else usage == []
        chunks = [c async for c in await client.completions.create(model="fake-tiny", prompt="hello", max_tokens=2,
                                                                   stream=True)]
        assert any(c.usage is not None for c in chunks) == forced
