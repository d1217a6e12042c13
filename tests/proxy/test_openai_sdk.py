"""The real openai SDK (sync, async, streaming) against a live server on loopback."""

import asyncio

import openai
import pytest

from tokendance.proxy.segment import SEP

MODEL = "fake-tiny"


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.client()


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("one two three"))
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", "one two three", "stop")
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_a_client_may_name_its_answer_as_in_vllm(client):
    """vLLM's request_id: the answer's id after its prefix (two requests may share one)."""
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=ask("a b"),
                                                         extra_body={"request_id": "agent-7:turn-3"})
    assert r.parse().id == "chatcmpl-agent-7:turn-3" and r.headers["X-Request-Id"] == r.parse().id
    chunks = list(client.completions.create(model=MODEL, prompt="c d", n=2, stream=True,
                                            extra_body={"request_id": "agent-7:turn-3"}))
    assert {c.id for c in chunks} == {"cmpl-agent-7:turn-3"}
    for bad in ("", "has space", "x" * 257, "new\nline"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask("a"), extra_body={"request_id": bad})
        assert e.value.body["param"] == "request_id"
    header = client.chat.completions.create(model=MODEL, messages=ask("a"), extra_body={"request_id": "body"},
                                            extra_headers={"X-Request-Id": "from-header"})
    assert header.id == "chatcmpl-from-header"  # the header first, as vLLM takes it
    r = client.responses.with_raw_response.create(model=MODEL, input="a", extra_headers={"X-Request-Id": "h"})
    assert r.parse().id.startswith("resp_") and r.parse().id != "resp_h"  # a stored response's key stays ours
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("a"), extra_body={"priority": 1})
    assert (e.value.body["param"], e.value.body["code"]) == ("priority", "unsupported")


def test_chat_stream_matches_the_whole_answer(client):
    msgs = ask("alpha beta gamma delta")
    whole = client.chat.completions.create(model=MODEL, messages=msgs)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_gives_the_counts_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage; alone it does nothing)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("alpha beta gamma"), stream=True,
                                                 stream_options=opts))
    *steps, last = chunks
    p = last.usage.prompt_tokens
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in steps] == \
        [(p, 0), (p, 1), (p, 2), (p, 3)]  # the role chunk, then a word each
    assert all(c.usage.prompt_tokens_details is None for c in steps)
    assert last.usage.prompt_tokens_details is not None and last.usage.completion_tokens == 3
    text = list(client.completions.create(model=MODEL, prompt="k l", stream=True, stream_options=opts))
    assert [c.usage.completion_tokens for c in text] == [1, 2, 2]
    alone = list(client.chat.completions.create(model=MODEL, messages=ask("x y"), stream=True,
                                                stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("x y"), stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_max_tokens_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("a b c d e"), max_tokens=2)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("a b ", "length")
    r = client.chat.completions.create(model=MODEL, messages=ask("a b c d e"), max_completion_tokens=3,
                                       max_tokens=1)
    assert r.usage.completion_tokens == 3


def test_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("red green blue"), stop=["blue", "zz"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("red green ", "stop")


def test_n_with_seed_and_temperature(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("p q r"), n=3, seed=0, temperature=1.0,
                                       top_p=0.9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # The fake rotates its answer by the seed; choice i samples with seed + i.
    assert [c.message.content for c in r.choices] == ["p q r", "q r p", "r p q"]
    assert r.usage.completion_tokens == 9


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("u v"), logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert [t.token for t in lp] == ["u ", "v"] and all(len(t.top_logprobs) == 2 for t in lp)
    r = client.chat.completions.create(model=MODEL, messages=ask("u v"))
    assert r.choices[0].logprobs is None


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt=["x y z", "p q"], n=2, logprobs=1)
    assert [(c.index, c.text) for c in r.choices] == [(0, "x y z"), (1, "x y z"), (2, "p q"), (3, "p q")]
    assert r.choices[0].logprobs.text_offset == [0, 2, 4]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 10


def test_completions_stream_and_token_prompt(client):
    chunks = list(client.completions.create(model=MODEL, prompt="k l m", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "k l m"
    assert chunks[-1].usage.completion_tokens == 3
    r = client.completions.create(model=MODEL, prompt=[7, 8, 9])
    assert r.choices[0].text == "t7 t8 t9"


@pytest.mark.parametrize("kind, extra, special", [
    ("chat", {}, False), ("chat", {"add_special_tokens": True}, True),
    ("completion", {}, True), ("completion", {"add_special_tokens": False}, False)])
def test_special_tokens_as_vllm_adds_them(client, live, kind, extra, special):
    # A text completion gets the tokenizer's BOS, a chat prompt (its template writes it) not.
    if kind == "chat":
        client.chat.completions.create(model=MODEL, messages=ask("a b"), extra_body=extra)
    else:
        client.completions.create(model=MODEL, prompt="a b", extra_body=extra)
    assert live.backend.groups[-1][0].add_special_tokens is special


def test_cached_tokens_count_reused_shared_blocks(client):
    block = "a long shared answer from round one that every agent sees"
    body = {"tokendance": {"separators": True}}
    for agent, cached in (("a", 0), ("b", len(block.split()))):
        r = client.chat.completions.create(
            model=MODEL, messages=ask(f"agent {agent} reads:{SEP}{block}{SEP}and replies"), extra_body=body)
        assert r.usage.prompt_tokens_details.cached_tokens == cached


def test_per_client_default_headers_and_inferred_rounds(live):
    c = live.client(default_headers={"X-TokenDance-Session": "sdk-hdr", "X-TokenDance-Agent": "solo"})
    rounds = []
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi", "name": "solo"}])
        assert raw.parse().choices[0].message.content == "hi"
        rounds.append(raw.headers["x-tokendance-round"])
    assert rounds == ["1", "2", "3"]
    stats = live.server.proxy.sessions.find("sdk-hdr", 3).view()
    assert stats["agents"] == ["solo"] and stats["requests"] == 1


async def test_async_client_concurrent(live):
    c = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="sk-test", max_retries=0)
    rs = await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=ask(f"word{i} end"))
                                for i in range(16)])
    assert [r.choices[0].message.content for r in rs] == [f"word{i} end" for i in range(16)]
    stream = await c.chat.completions.create(model=MODEL, messages=ask("s t"), stream=True)
    assert "".join([ch.choices[0].delta.content or "" async for ch in stream]) == "s t"
    await c.close()


def test_sdk_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=ask("x"))
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
