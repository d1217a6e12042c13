"""vLLM's `--response-role`: a chat answer's role where the request adds the generation
prompt (its default), else the role its last message has, streamed or not."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .conftest import FakeBackend, Threaded

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def bot() -> Iterator[Threaded]:
    t = Threaded(FakeBackend(length=6), response_role="bot")
    yield t
    t.close()


def chat(server: Threaded, **body) -> httpx.Response:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": server.backend.info.name, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_the_answer_takes_the_servers_role(bot):
    assert chat(bot, messages=ASK).json()["choices"][0]["message"]["role"] == "bot"
    client = bot.client()
    first = next(iter(client.chat.completions.create(model=bot.backend.info.name, messages=ASK, max_tokens=4, stream=True)))
    assert first.choices[0].delta.role == "bot"


def test_without_the_generation_prompt_the_last_messages_role(bot):
    go_on = [*ASK, {"role": "assistant", "content": "Blue, or"}]
    body = dict(add_generation_prompt=False, continue_final_message=True)
    assert chat(bot, messages=go_on, **body).json()["choices"][0]["message"]["role"] == "assistant"
    assert chat(bot, messages=ASK, add_generation_prompt=False).json()["choices"][0]["message"]["role"] == "user"

