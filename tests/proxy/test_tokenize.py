"""vLLM's /tokenize and /detokenize: the ids a completion or chat of the same prompt
gets (its usage counts them), the text back from ids, and 4xx for bad bodies."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Oslo?"}]


async def post(url: str, path: str, body: Any) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as resp:
            return resp.status, await resp.json()


@pytest.fixture(scope="module")
def client(engine_live) -> openai.OpenAI:
    return engine_live.client("sk-tok")


async def test_a_prompt_tokenizes_as_its_completion_does(engine_live, client):
    model, text = engine_live.backend.info.name, "The bridge opens at five."
    status, got = await post(engine_live.url, "/tokenize", {"model": model, "prompt": text,
                                                            "return_token_strs": True})
    used = client.completions.create(model=model, prompt=text, max_tokens=1).usage.prompt_tokens
    tok = engine_live.backend.tokenizer
    assert status == 200 and got["count"] == len(got["tokens"]) == used
    assert got["tokens"] == tok(text)["input_ids"] and got["max_model_len"] == engine_live.backend.info.max_model_len
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    status, back = await post(engine_live.url, "/detokenize", {"model": model, "tokens": got["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(got["tokens"])} and text in back["prompt"]


@pytest.mark.parametrize("tools", [None, [TOOL]])
async def test_messages_tokenize_as_their_chat_does(engine_live, client, tools):
    model = engine_live.backend.info.name
    body: dict[str, Any] = {"model": model, "messages": CHAT, **({"tools": tools} if tools else {})}
    status, got = await post(engine_live.url, "/tokenize", body)
    used = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                          **({"tools": tools} if tools else {})).usage.prompt_tokens
    assert status == 200 and got["count"] == used and got["token_strs"] is None
    if tools:  # a template without tools gets them written into the messages
        _, plain = await post(engine_live.url, "/tokenize", {"model": model, "messages": CHAT})
        assert got["count"] > plain["count"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "code"}]}, 400, "tools[0].type"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
async def test_bad_bodies_are_4xx_naming_the_field(engine_live, path, body, status, param):
    got_status, got = await post(engine_live.url, path, body)
    assert got_status == status and got["error"]["param"] == param and got["error"]["message"]


async def test_a_backend_without_a_tokenizer_says_so(server):
    status, got = await post(server.url, "/tokenize", {"prompt": "a"})
    assert status == 501 and "no tokenizer" in got["error"]["message"]


THINKING = (  # Qwen3's switch, in a template written for this test
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": True}},
])
async def test_the_template_renders_as_vllms_fields_say(engine_live, client, fields):
    """vLLM's chat fields reach the template: the chat's prompt is what the tokenizer's
    apply_chat_template gives with them, and /tokenize counts it the same."""
    model, tok = engine_live.backend.info.name, engine_live.backend.tokenizer
    chat = CHAT + ([{"role": "assistant", "content": "It is"}] if fields.get("continue_final_message") else [])
    saved, tok.chat_template = tok.chat_template, THINKING
    try:
        status, got = await post(engine_live.url, "/tokenize", {"model": model, "messages": chat, **fields})
        used = client.chat.completions.create(model=model, messages=chat, max_tokens=1,
                                              extra_body=fields).usage.prompt_tokens
        _, plain = await post(engine_live.url, "/tokenize", {"model": model, "messages": chat})
        kw = fields.get("chat_template_kwargs", {})
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=fields.get(
            "add_generation_prompt", True), continue_final_message=fields.get("continue_final_message", False), **kw)
    finally:
        tok.chat_template = saved
    assert status == 200 and got["count"] == used == len(tok(text, add_special_tokens=False)["input_ids"])
    if fields.get("continue_final_message"):
        assert text.endswith("It is")  # left open: the model goes on with it
    thinking_off = kw.get("enable_thinking") is False
    assert (got["count"] > plain["count"]) == thinking_off
    assert (got["count"] < plain["count"]) == ("add_generation_prompt" in fields)
