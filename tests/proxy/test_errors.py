"""Every client mistake is a 4xx in OpenAI's error shape, and does no work in the engine."""

import asyncio
import json

import aiohttp
import pytest
import structlog

M = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-tiny", "messages": M}
TEXT = {"model": "fake-tiny", "prompt": "hi"}

CASES = [  # (path, body or raw bytes, extra headers, status, param, code)
    ("chat", b"{bad", {}, 400, None, "invalid_json"),
    ("chat", b"", {}, 400, None, "invalid_json"),
    ("chat", b"[1, 2]", {}, 400, None, "invalid_type"),
    ("chat", b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, None, "invalid_json"),
    ("chat", {"messages": M}, {}, 400, "model", "invalid_type"),
    ("chat", {"model": "fake-tiny"}, {}, 400, "messages", "invalid_type"),
    ("chat", {**CHAT, "messages": "hi"}, {}, 400, "messages", "invalid_type"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content",
     "invalid_type"),
    ("chat", {**CHAT, "messages": [{"content": "x"}]}, {}, 400, "messages[0].role", "invalid_type"),
    ("chat", {**CHAT, "messages": []}, {}, 400, "messages", None),
    ("chat", {**CHAT, "max_tokens": "10"}, {}, 400, "max_tokens", "invalid_type"),
    ("chat", {**CHAT, "max_tokens": 0}, {}, 400, "max_tokens", None),
    ("chat", {**CHAT, "max_tokens": -5}, {}, 400, "max_tokens", None),
    ("chat", {**CHAT, "max_completion_tokens": 0}, {}, 400, "max_completion_tokens", None),
    ("chat", {**CHAT, "temperature": 3}, {}, 400, "temperature", None),
    ("chat", {**CHAT, "temperature": "hot"}, {}, 400, "temperature", "invalid_type"),
    ("chat", {**CHAT, "top_p": 0}, {}, 400, "top_p", None),
    ("chat", {**CHAT, "n": 0}, {}, 400, "n", None),
    ("chat", {**CHAT, "n": 1000}, {}, 400, "n", None),
    ("chat", {**CHAT, "n": True}, {}, 400, "n", "invalid_type"),
    ("chat", {**CHAT, "seed": 1.5}, {}, 400, "seed", "invalid_type"),
    ("chat", {**CHAT, "seed": 2**64}, {}, 400, "seed", None),
    ("chat", {**CHAT, "seed": -2**63 - 1, "n": 2}, {}, 400, "seed", None),
    ("chat", {**CHAT, "stop": [""]}, {}, 400, "stop", None),
    ("chat", {**CHAT, "stop": [1]}, {}, 400, "stop[0]", "invalid_type"),
    ("chat", {**CHAT, "stream": "yes"}, {}, 400, "stream", "invalid_type"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, {}, 400, "stream_options", None),
    ("chat", {**CHAT, "top_logprobs": 2}, {}, 400, "top_logprobs", None),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 30}, {}, 400, "top_logprobs", None),
    ("chat", {**CHAT, "model": "gpt-4o"}, {}, 404, "model", "model_not_found"),
    ("chat", {**CHAT, "tool_choice": "auto"}, {}, 400, "tool_choice", None),
    ("chat", {**CHAT, "tools": {"type": "function"}}, {}, 400, "tools", "invalid_type"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, {}, 400,
     "tools[0].function.parameters", "invalid_type"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f/g"}}]}, {}, 400,
     "tools[0].function.name", None),
    ("chat", {**CHAT, "tools": [{"type": "code_interpreter"}]}, {}, 400, "tools[0].type", "unsupported"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 5}, {}, 400,
     "tool_choice", "invalid_type"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, {}, 400,
     "tool_choice.function.name", None),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, {}, 400, "tool_choice", None),
    ("chat", {**CHAT, "functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     {}, 400, "functions", None),
    ("chat", {**CHAT, "functions": [{"description": "no name"}]}, {}, 400, "functions[0].name", "invalid_type"),
    ("chat", {**CHAT, "function_call": "auto"}, {}, 400, "function_call", None),
    ("chat", {**CHAT, "functions": [{"name": "f"}], "function_call": "always"}, {}, 400, "function_call", None),
    ("chat", {**CHAT, "functions": [{"name": "f"}], "function_call": {"name": "g"}}, {}, 400,
     "function_call.name", None),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     {}, 400, "messages[0].function_call", None),
    ("chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, {}, 400,
     "messages[0].tool_calls[0].function.arguments", None),
    ("chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]},
     {}, 400, "messages[0].tool_calls[0].function", "invalid_type"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]}, {}, 400, "messages[0].tool_calls", None),
    ("chat", {**CHAT, "messages": [{"role": "tool", "tool_call_id": "1"}]}, {}, 400, "messages[0].content", None),
    ("chat", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, {}, 400, "messages[0].name", None),
    ("chat", {**CHAT, "response_format": "json"}, {}, 400, "response_format", "invalid_type"),
    ("chat", {**CHAT, "continue_final_message": True}, {}, 400, "continue_final_message", None),
    ("chat", {**CHAT, "chat_template_kwargs": {"messages": []}}, {}, 400, "chat_template_kwargs", None),
    ("chat", {**CHAT, "chat_template_kwargs": "x"}, {}, 400, "chat_template_kwargs", "invalid_type"),
    ("chat", {**CHAT, "response_format": {"type": "xml"}}, {}, 400, "response_format.type", None),
    ("chat", {**CHAT, "response_format": {"type": "json_schema"}}, {}, 400,
     "response_format.json_schema.schema", None),
    ("chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, {}, 400,
     "response_format.json_schema.schema", "invalid_type"),
    ("chat", {**CHAT, "response_format": {"type": "structural_tag"}}, {}, 400, "response_format", None),
    ("chat", {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, {},
     400, "structured_outputs", None),
    ("chat", {**CHAT, "structured_outputs": {}}, {}, 400, "structured_outputs", None),
    ("chat", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, {}, 400, "structured_outputs",
     None),
    ("chat", {**CHAT, "structured_outputs": {"choice": []}}, {}, 400, "structured_outputs.choice", None),
    ("chat", {**CHAT, "structured_outputs": {"choice": ["a", ""]}}, {}, 400, "structured_outputs.choice", None),
    ("chat", {**CHAT, "structured_outputs": {"choice": "a"}}, {}, 400, "structured_outputs.choice",
     "invalid_type"),
    ("chat", {**CHAT, "structured_outputs": {"structural_tag": "{not json"}}, {}, 400,
     "structured_outputs.structural_tag", None),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
      "response_format": {"type": "json_object"}}, {}, 400, "tools", None),
    ("text", {**TEXT, "structured_outputs": {"grammar": ""}}, {}, 400, "structured_outputs.grammar", None),
    ("text", {**TEXT, "structured_outputs": {"json": 5}}, {}, 400, "structured_outputs.json", "invalid_type"),
    ("chat", {**CHAT, "logit_bias": {"abc": -100}}, {}, 400, "logit_bias", None),
    ("chat", {**CHAT, "logit_bias": {"-5": 1}}, {}, 400, "logit_bias", None),
    ("chat", {**CHAT, "logit_bias": {"9" * 5000: 1}}, {}, 400, "logit_bias", None),
    ("chat", {**CHAT, "logit_bias": {"50256": -100.5}}, {}, 400, "logit_bias", None),
    ("chat", {**CHAT, "logit_bias": {"50256": "x"}}, {}, 400, "logit_bias", "invalid_type"),
    ("chat", {**CHAT, "presence_penalty": 2.5}, {}, 400, "presence_penalty", None),
    ("chat", {**CHAT, "frequency_penalty": -3}, {}, 400, "frequency_penalty", None),
    ("chat", {**CHAT, "repetition_penalty": 0}, {}, 400, "repetition_penalty", None),
    ("chat", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "messages[0].role", None),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, {}, 400, "messages[0].content[0]",
     "unsupported"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": None}]}, {}, 400, "messages[0].content", None),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "w " * 5000}]}, {}, 400, "messages",
     "context_length_exceeded"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": ""}]}, {"X-TokenDance-Session": "a/b"}, 400,
     "tokendance.session", None),
    ("chat", CHAT, {"X-TokenDance-Session": "s", "X-TokenDance-Round": "abc"}, 400, "tokendance.round", None),
    ("chat", CHAT, {"X-TokenDance-Session": "s", "X-TokenDance-Round": "\u00b2"}, 400, "tokendance.round", None),
    ("chat", CHAT, {"X-TokenDance-Session": "s", "X-TokenDance-Round": "9" * 5000}, 400, "tokendance.round", None),
    ("chat", CHAT, {"X-TokenDance-Session": "s", "X-TokenDance-Round": str(2**63)}, 400, "tokendance.round", None),
    ("chat", {**CHAT, "tokendance": {"round": 2**63, "session": "s"}}, {}, 400, "tokendance.round", None),
    ("chat", CHAT, {"X-TokenDance-Mode": "turbo"}, 400, "tokendance.mode", None),
    ("chat", CHAT, {"X-TokenDance-Separators": "maybe"}, 400, "tokendance.separators", None),
    ("chat", {**CHAT, "tokendance": {"round": "x"}}, {}, 400, "tokendance.round", "invalid_type"),
    ("chat", {**CHAT, "tokendance": {"round": -1, "session": "s"}}, {}, 400, "tokendance.round", None),
    ("chat", {**CHAT, "tokendance": "s1"}, {}, 400, "tokendance", "invalid_type"),
    ("chat", {**CHAT, "tokendance": {"sesion": "s1"}}, {}, 400, "tokendance", "invalid_type"),
    ("chat", {**CHAT, "use_beam_search": True}, {}, 400, "use_beam_search", "unsupported"),
    ("text", {**TEXT, "use_beam_search": True}, {}, 400, "use_beam_search", "unsupported"),
    ("chat", {**CHAT, "chat_template": "{{ messages }}"}, {}, 400, "chat_template", None),  # untrusted
    ("text", {"model": "fake-tiny"}, {}, 400, "prompt", "invalid_type"),
    ("text", {**TEXT, "prompt": 5}, {}, 400, "prompt", "invalid_type"),
    ("text", {**TEXT, "prompt": [1, "a"]}, {}, 400, "prompt", None),
    ("text", {**TEXT, "prompt": []}, {}, 400, "prompt", None),
    ("text", {**TEXT, "prompt": [[1], [-2]]}, {}, 400, "prompt", None),
    ("text", {**TEXT, "prompt": ""}, {}, 400, "prompt", None),
    ("text", {**TEXT, "prompt": "w " * 5000}, {}, 400, "prompt", "context_length_exceeded"),
    ("text", {**TEXT, "prompt": [5, 6], "echo": True}, {}, 400, "echo", "unsupported"),  # no tokenizer
    ("text", {**TEXT, "max_tokens": 0}, {}, 400, "max_tokens", None),  # only with echo
    ("text", {**TEXT, "suffix": "end"}, {}, 400, "suffix", "unsupported"),
    ("text", {**TEXT, "best_of": 3}, {}, 400, "best_of", "unsupported"),
    ("text", {**TEXT, "best_of": 1, "n": 2}, {}, 400, "best_of", "unsupported"),  # fewer than n
    ("text", {**TEXT, "logprobs": 21}, {}, 400, "logprobs", None),  # vLLM's --max-logprobs, not OpenAI's 5
    ("text", {**TEXT, "prompt_logprobs": 21}, {}, 400, "prompt_logprobs", None),
    ("chat", {**CHAT, "prompt_logprobs": -1}, {}, 400, "prompt_logprobs", None),  # vLLM's whole vocabulary
    ("chat", {**CHAT, "prompt_logprobs": 2, "stream": True}, {}, 400, "prompt_logprobs", None),
    ("text", {**TEXT, "repetition_penalty": -1.0}, {}, 400, "repetition_penalty", None),
    ("text", {**TEXT, "frequency_penalty": 2.01}, {}, 400, "frequency_penalty", None),
    ("text", {**TEXT, "max_tokens": 0}, {}, 400, "max_tokens", None),
    ("text", {**TEXT, "min_p": 1.5}, {}, 400, "min_p", None),
    ("chat", {**CHAT, "min_p": -0.1}, {}, 400, "min_p", None),
    ("chat", {**CHAT, "min_tokens": -1}, {}, 400, "min_tokens", None),
    ("chat", {**CHAT, "max_tokens": 4, "min_tokens": 5}, {}, 400, "min_tokens", None),
    ("text", {**TEXT, "min_tokens": "many"}, {}, 400, "min_tokens", "invalid_type"),
    ("text", {**TEXT, "skip_special_tokens": "no"}, {}, 400, "skip_special_tokens", "invalid_type"),
]
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


async def check(resp: aiohttp.ClientResponse, status: int) -> dict:
    assert resp.status == status
    assert resp.content_type == "application/json"
    body = await resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("path,body,headers,status,param,code", CASES,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
async def test_bad_input_is_a_4xx_with_a_message(server, path, body, headers, status, param, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + PATHS[path], data=data, headers=headers) as resp:
            err = await check(resp, status)
    assert (err["param"], err["code"]) == (param, code)
    assert server.proxy.backend.groups == []  # nothing reached the engine
    assert server.proxy.in_flight == 0


async def test_a_name_in_header_bytes_that_are_not_utf8_is_a_400(server):
    """aiohttp reads such bytes as surrogates, which no MQTT topic (nor UTF-8) can carry."""
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nX-TokenDance-Session: caf\xe9\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    raw = await reader.read()
    writer.close()
    head, _, data = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(data)["error"]["param"] == "tokendance.session"
    assert server.proxy.backend.groups == []


async def test_unknown_fields_are_ignored_and_logged(server):
    body = {**CHAT, "frobnicate": {"x": [1]}, "messages": [{"role": "user", "content": "ok", "extra": 1}],
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
            "best_effort": True}
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + PATHS["chat"], json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["message"]["content"] == "ok"
            async with http.post(server.url + PATHS["chat"], json=CHAT) as resp:
                assert resp.status == 200
    ignored = [e for e in logs if e["event"] == "fields ignored"]
    assert [(e["fields"], e["body"], e["log_level"]) for e in ignored] == [
        (["best_effort", "frobnicate"], "ChatRequest", "warning")]


async def test_routes_and_control_endpoints_answer_in_the_same_shape(server):
    base = server.url + "/v1/tokendance/sessions"
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/v1/nothing") as resp:
            assert (await check(resp, 404))["code"] == "unknown_url"
        async with http.get(server.url + PATHS["chat"]) as resp:
            assert (await check(resp, 405))["code"] == "method_not_allowed"
        async with http.get(server.url + "/v1/models/other") as resp:
            assert (await check(resp, 404))["code"] == "model_not_found"
        async with http.post(base + "/s/rounds/x") as resp:
            assert (await check(resp, 400))["param"] == "round"
        async with http.post(base + "/s/rounds/%C2%B2") as resp:  # '²': a digit int() refuses
            assert (await check(resp, 400))["param"] == "round"
        for huge in ("9" * 5000, str(2**63)):  # past int()'s 4300 digits; past the body's int64
            async with http.post(f"{base}/s/rounds/{huge}") as resp:
                assert (await check(resp, 400))["param"] == "round"
            async with http.get(f"{base}/s/rounds/{huge}") as resp:
                assert (await check(resp, 400))["param"] == "round"
        async with http.post(base + "/s/rounds/1", data=b'{"agents": "a"}') as resp:
            assert (await check(resp, 400))["param"] == "agents"
        async with http.post(base + "/s/rounds/1", data=b'{"agents": ["a", "x/y"]}') as resp:
            assert (await check(resp, 400))["param"] == "agents[1]"
        async with http.post(base + "/s/rounds/1", data=b'{"timeout_ms": -1}') as resp:
            assert (await check(resp, 400))["param"] == "timeout_ms"
        async with http.post(base + "/s%2Bt/rounds/1") as resp:
            assert (await check(resp, 400))["param"] == "session"
        async with http.get(base + "/never/rounds/1") as resp:
            assert (await check(resp, 404))["code"] == "round_not_found"


async def test_a_template_that_rejects_the_messages_is_a_400(start, make_backend):
    from tokendance.backend.api import InvalidRequest

    be = make_backend()

    def reject(messages):
        raise InvalidRequest("messages do not fit the model's chat template", "messages")

    be.render_chat = reject
    server = await start(be)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + PATHS["chat"], json=CHAT) as resp:
            assert (await check(resp, 400))["param"] == "messages"
    assert 'tokendance_requests_total{code="400",endpoint="chat"} 1' in server.proxy.metrics.render()
