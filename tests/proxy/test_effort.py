"""vLLM's reasoning effort: a chat's `reasoning_effort`, a response's `reasoning.effort`
and a message's `output_config.effort` / `thinking` reach the chat template as
`reasoning_effort`, and switch `enable_thinking` (off for "none") unless the request's
template kwargs set it."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tokendance.proxy import serve
from tokendance.proxy.schemas import template

from .conftest import Threaded

TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
            "|effort={{ reasoning_effort | default('-') }}|thinking={{ enable_thinking | default('-') }}|")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="full")
    serve.chat_template(be, TEMPLATE)
    t = Threaded(be)
    yield t
    t.close()


def rendered(server, **extra) -> str:
    out = server.client().chat.completions.create(model=server.backend.info.name, messages=HI, max_tokens=1,
                                                  extra_body={"return_token_ids": True, **extra})
    return server.backend.tokenizer.decode(out.model_extra["prompt_token_ids"])


def test_a_chats_effort_reaches_the_template(server):
    assert rendered(server).endswith("|effort=-|thinking=-|")
    assert rendered(server, reasoning_effort="low").endswith("|effort=low|thinking=True|")
    assert rendered(server, reasoning_effort="none").endswith("|effort=none|thinking=False|")
    kept = rendered(server, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert kept.endswith("|effort=high|thinking=False|")
    with pytest.raises(openai.BadRequestError) as e:
        rendered(server, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"


def prompt_tokens(server, effort: str | None) -> int:
    extra = {"reasoning_effort": effort} if effort else {}
    return server.client().chat.completions.create(model=server.backend.info.name, messages=HI, max_tokens=1,
                                                   extra_body=extra).usage.prompt_tokens


def test_a_responses_and_a_messages_effort_are_the_chats(server):
    name = server.backend.info.name
    assert prompt_tokens(server, "medium") != prompt_tokens(server, None)  # the template shows it
    got = server.client().responses.create(model=name, input=HI, max_output_tokens=1, reasoning={"effort": "medium"})
    assert got.usage.input_tokens == prompt_tokens(server, "medium")
    claude = anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0)
    for kw, effort in (({"output_config": {"effort": "medium"}}, "medium"), ({"thinking": {"type": "disabled"}}, "none")):
        u = claude.messages.create(model=name, max_tokens=1, messages=HI, extra_body=kw).usage
        assert u.input_tokens + u.cache_read_input_tokens == prompt_tokens(server, effort), kw
    bad = httpx.post(server.url + "/v1/responses", json={"model": name, "input": "a", "reasoning": {"effort": "x"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"


def test_the_effort_goes_under_the_requests_own_kwargs():
    assert template(None, True, False, "low").kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert template({"enable_thinking": True}, True, False, "none").kwargs == {
        "reasoning_effort": "none", "enable_thinking": True}
    assert template(None, True, False) is None
