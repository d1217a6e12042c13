"""vLLM's `--trust-request-chat-template`: a request's own `chat_template` renders its
chat (completions, /tokenize, chat embeddings) where the server trusts them, and is a 400
naming the field where it does not or where the template fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import Threaded

OWN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
TOOLS = ("{% if tools %}[tools] {% for t in tools %}{{ t.function.name }} {% endfor %}"
         "reply with <tool_call>{...}</tool_call>\n{% endif %}" + OWN)
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def trusted(tiny_llama: Path) -> Iterator[Threaded]:
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"), barrier_timeout=10.0,
                 trust_chat_template=True)
    yield t
    t.close()


def post(server: Threaded, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": server.backend.info.name, **body}, timeout=60)


def prompt_text(server: Threaded, **body: Any) -> str:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_prompt_text": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt_text"]


def test_a_trusted_request_renders_with_its_own_template(trusted):
    tok = trusted.backend.tokenizer
    text = prompt_text(trusted, chat_template=OWN)
    assert text == "[system] Be brief.\n[user] What time is it?\n[bot]"
    assert prompt_text(trusted) == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    counted = post(trusted, "/tokenize", {"messages": CHAT, "chat_template": OWN}).json()["count"]
    embedded = post(trusted, "/v1/embeddings", {"messages": CHAT, "chat_template": OWN}).json()["usage"]
    assert counted == n and embedded["prompt_tokens"] == len(tok(text.removesuffix("[bot]"),
                                                                 add_special_tokens=False)["input_ids"])
    # with the template's variables and an open last message, as the server's template takes them
    kept = prompt_text(trusted, chat_template="{{ greeting }}" + OWN, chat_template_kwargs={"greeting": "hey "},
                       messages=[*CHAT, {"role": "assistant", "content": "It is"}],
                       add_generation_prompt=False, continue_final_message=True)
    assert kept.startswith("hey [system]") and kept.endswith("[assistant] It is")


def test_the_templates_tools_are_its_own(trusted):
    """A template that renders tools gets them; one that does not gets them written into
    the messages by the proxy; either way the answer's calls are read."""
    rendered = prompt_text(trusted, chat_template=TOOLS, tools=[TOOL])
    assert rendered.startswith("[tools] get_time reply with <tool_call>") and "<tools>" not in rendered
    written = prompt_text(trusted, chat_template=OWN, tools=[TOOL])
    assert written.startswith("[system] ") and "get_time" in written and "[tools]" not in written
    counted = post(trusted, "/tokenize", {"messages": CHAT, "chat_template": TOOLS, "tools": [TOOL]}).json()
    assert counted["count"] == len(trusted.backend.tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("template,reason", [
    ("{% for m in messages %}", "does not render"),  # not Jinja
    ("{{ raise_exception('system messages only') }}", "system messages only"),
])
def test_a_template_that_fails_is_a_400_naming_it(trusted, template, reason):
    for path, body in [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                       ("/tokenize", {"messages": CHAT}), ("/v1/embeddings", {"messages": CHAT})]:
        r = post(trusted, path, {**body, "chat_template": template})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "chat_template" and reason in r.json()["error"]["message"], path
    assert prompt_text(trusted, chat_template=OWN).startswith("[system]")  # the server goes on


def test_an_untrusting_server_refuses_a_requests_template(engine_live):
    for path, body in [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                       ("/tokenize", {"messages": CHAT}), ("/v1/embeddings", {"messages": CHAT})]:
        r = post(engine_live, path, {**body, "chat_template": OWN})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"], path
    with pytest.raises(openai.BadRequestError):  # as the SDK sends it
        engine_live.client().chat.completions.create(model=engine_live.backend.info.name, messages=CHAT,
                                                     max_tokens=1, extra_body={"chat_template": OWN})
