"""vLLM's batch of chats (`/v1/chat/completions/batch`): one choice per conversation,
each what the conversation alone would get; a round's agents in one request, their
shared answers reused the next round; a 400 for what a batch does not take."""

from __future__ import annotations

import time

import httpx
import pytest

from tokendance.examples.echo import EchoBackend

from .conftest import Threaded

CONVS = [[{"role": "user", "content": "Name a color."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a number."}],
         [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
          {"role": "user", "content": "Again."}]]


def batch(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions/batch", json=body, timeout=60, **kw)


def test_each_conversation_gets_what_it_would_alone(engine_live, engine_client, engine_model):
    kw = {"model": engine_model, "max_tokens": 6, "temperature": 0}
    r = batch(engine_live.url, {**kw, "messages": CONVS, "return_token_ids": True}, headers={"X-Request-Id": "b1"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["id"] == "chatcmpl-b1" and got["object"] == "chat.completion"
    assert [c["index"] for c in got["choices"]] == [0, 1, 2] and "prompt_token_ids" not in got
    alone = [engine_client.chat.completions.create(**kw, messages=c) for c in CONVS]
    for c, a in zip(got["choices"], alone):
        assert c["message"]["content"] == a.choices[0].message.content
        assert c["finish_reason"] == a.choices[0].finish_reason and len(c["token_ids"]) == a.usage.completion_tokens
    assert got["usage"]["prompt_tokens"] == sum(a.usage.prompt_tokens for a in alone)
    assert got["usage"]["completion_tokens"] == sum(a.usage.completion_tokens for a in alone)


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"n": 2}, "n"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [CONVS[0], []]}, "messages"),
    ({"messages": [CONVS[0], [{"role": "robot", "content": "x"}]]}, "messages[1][0].role"),
    ({"messages": CONVS[0]}, "messages[0]"),
    ({"tokendance": {"agents": ["a", "b"]}}, "tokendance.agents"),
    ({"tokendance": {"agents": ["a", "b", "c/d"]}}, "tokendance.agents"),
], ids=["stream", "tools", "functions", "n", "prompt-logprobs", "empty", "empty-conversation", "bad-role", "not-a-batch",
        "two-agents-for-three", "bad-agent-name"])
def test_what_a_batch_does_not_take_is_a_400(engine_live, engine_model, extra, param):
    r = batch(engine_live.url, {"model": engine_model, "max_tokens": 4, "messages": CONVS, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_agents_name_a_batchs_conversations_or_a_completions_prompts(engine_live, engine_model):
    r = batch(engine_live.url, {"model": engine_model, "max_tokens": 2, "messages": CONVS},
              headers={"X-TokenDance-Session": "named", "X-TokenDance-Agents": "ada, bo,cy"})
    assert r.status_code == 200, r.text
    stats = httpx.get(engine_live.url + "/v1/tokendance/sessions/named/rounds/1").json()
    assert stats["requests"] == 1 and stats["group_sizes"] == [3]
    base = {"model": engine_model, "max_tokens": 2, "prompt": ["a", "b"]}
    two = httpx.post(engine_live.url + "/v1/completions", json={**base, "tokendance": {"agents": ["x", "y"]}})
    assert two.status_code == 200, two.text
    one = httpx.post(engine_live.url + "/v1/completions", json={**base, "tokendance": {"agents": ["x"]}})
    chat = httpx.post(engine_live.url + "/v1/chat/completions", json={
        "model": engine_model, "max_tokens": 2, "messages": CONVS[0], "tokendance": {"agents": ["x", "y"]}})
    assert [x.json()["error"]["param"] for x in (one, chat)] == ["tokendance.agents"] * 2


def test_a_round_in_one_batch_reuses_the_last_rounds_answers():
    """A batch is its round's group: it starts at once, whatever the barrier's timeout."""
    t = Threaded(EchoBackend("collective"), barrier_timeout=30.0)
    try:
        t0 = time.perf_counter()
        h = {"X-TokenDance-Session": "batch", "X-TokenDance-Agents": "ada,bo,cy"}
        first = batch(t.url, {"model": t.backend.info.name, "max_tokens": 12, "messages": CONVS}, headers=h)
        answers = [c["message"]["content"] for c in first.json()["choices"]]
        quote = "\n\n".join(f"Agent {i} said:\n{a}" for i, a in enumerate(answers))
        second = batch(t.url, {"model": t.backend.info.name, "max_tokens": 12, "messages": [
            [{"role": "user", "content": f"You are agent {i}. {quote}\n\nWhat now?"}] for i in range(3)]}, headers=h)
        assert first.headers["X-TokenDance-Round"] == "1" and second.headers["X-TokenDance-Round"] == "2"
        assert time.perf_counter() - t0 < 10  # not held for the barrier's 30 s
        u = second.json()["usage"]
        assert u["tokendance"]["shared_tokens"] > 0 and u["prompt_tokens_details"]["cached_tokens"] > 0
        stats = httpx.get(t.url + "/v1/tokendance/sessions/batch/rounds/2").json()
        assert stats["groups"] == 1 and stats["group_sizes"] == [3] and stats["agents"] == ["ada", "bo", "cy"]
        rows = stats["per_agent"]
        assert sorted(rows) == ["ada", "bo", "cy"] and sum(r["prompt_tokens"] for r in rows.values()) == \
            second.json()["usage"]["prompt_tokens"]
    finally:
        t.close()
