"""vLLM's stream_interval: a streamed choice's tokens come `interval` to a chunk, its
first and its last at once; a request may raise the server's `--stream-interval`, never
lower it. The fake backend answers a prompt by echoing its words."""

from __future__ import annotations

import openai
import pytest

from .conftest import FakeBackend, Threaded

WORDS = " ".join(f"w{i}" for i in range(10))


@pytest.fixture(scope="module")
def three():
    t = Threaded(FakeBackend(length=40), stream_interval=3)
    yield t
    t.close()


def sizes(chunks) -> list[int]:
    """Tokens (by their ids, vLLM's return_token_ids) per chunk with any, of choice 0."""
    return [len(c.choices[0].model_extra["token_ids"]) for c in chunks
            if c.choices and c.choices[0].index == 0 and c.choices[0].model_extra.get("token_ids")]


def test_a_request_sends_its_tokens_interval_at_a_time(client):
    kw = dict(model="fake-tiny", messages=[{"role": "user", "content": WORDS}], stream=True)
    chunks = list(client.chat.completions.create(**kw, extra_body={"stream_interval": 4, "return_token_ids": True}))
    assert sizes(chunks) == [1, 4, 4, 1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WORDS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    plain = list(client.chat.completions.create(**kw, extra_body={"return_token_ids": True}))
    assert sizes(plain) == [1] * 10
    text = list(client.completions.create(model="fake-tiny", prompt=WORDS, stream=True, n=2, max_tokens=10,
                                          extra_body={"stream_interval": 5, "return_token_ids": True}))
    for i in (0, 1):
        got = [len(c.choices[0].model_extra["token_ids"]) for c in text if c.choices and c.choices[0].index == i]
        assert got == [1, 5, 4]
    assert "".join(c.choices[0].text for c in text if c.choices and c.choices[0].index == 1) == WORDS


def test_the_servers_interval_is_the_least(three):
    kw = dict(model="fake-tiny", messages=[{"role": "user", "content": WORDS}], stream=True)
    c = three.client()
    assert sizes(list(c.chat.completions.create(**kw, extra_body={"return_token_ids": True}))) == [1, 3, 3, 3]
    assert sizes(list(c.chat.completions.create(**kw, extra_body={"stream_interval": 1,
                                                                   "return_token_ids": True}))) == [1, 3, 3, 3]
    assert sizes(list(c.chat.completions.create(**kw, extra_body={"stream_interval": 9,
                                                                   "return_token_ids": True}))) == [1, 9]


def test_an_interval_below_one_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-tiny", messages=[{"role": "user", "content": "a"}],
                                       stream=True, extra_body={"stream_interval": 0})
    assert e.value.body["param"] == "stream_interval"
