"""Random request bodies (chats, completions, responses, conversations) against the real engine (seeded, so a failure replays): no body
gets a 5xx or a stream's error event; every 4xx has OpenAI's error shape; the engine
serves on afterwards. Requests go several at a time, so good and bad ones share steps."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from tokendance.backend.api import MODES

WILD = [None, True, False, 0, 1, -1, 3, 0.5, -0.5, 1.5, 2**31, 2**63, 2**64, 1e308, -1e308, 1e-320, "", "x",
        "auto", "none", "required", "json_object", "function", "user", "tool", "collective", [], {}, [1, 2],
        ["a"], {"a": 1}, "\u0000", "a" * 3000]
KEYS = ["type", "role", "content", "name", "function", "json_schema", "schema", "regex", "choice", "grammar",
        "session", "agent", "round", "mode", "arguments", "id", "tool_calls", "include_usage", "json", "strict",
        "parameters", "format", "structures", "triggers"]
FIELDS = ["messages", "prompt", "n", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "min_tokens", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos",
          "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "tokendance",
          "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens", "echo", "best_of",
          "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "prompt_logprobs",
          "allowed_token_ids", "bad_words", "return_token_ids", "truncate_prompt_tokens", "truncation_side",
          "return_tokens_as_token_ids", "request_id", "priority", "logprob_token_ids", "repetition_detection",
          "thinking_token_budget", "stream_interval", "include_reasoning", "return_prompt_text", "use_beam_search",
          "length_penalty"]
TOOLS = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "g"}}]
PLAUSIBLE: dict[str, Any] = {
    "n": [1, 2, 3], "stop": [["e"], ["the", "a"], "\n"], "max_tokens": [1, 5, 12], "temperature": [0, 0.7, 2, 1e-6],
    "top_p": [1, 0.5, 0.01], "top_k": [0, 1, 5, 10**6], "min_p": [0, 0.1, 1], "min_tokens": [0, 2, 5],
    "seed": [-5, 7, 2**40], "stream": [True], "ignore_eos": [True, False], "stop_token_ids": [[17], [2, 3]],
    "presence_penalty": [-2, 1.5], "frequency_penalty": [2, -1], "repetition_penalty": [0.5, 1.3, 1e-320, 50.0],
    "logit_bias": [{"17": 100}, {"5": -100}], "include_stop_str_in_output": [True], "skip_special_tokens": [False],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"k": {"type": "string"}}}}}],
    "structured_outputs": [{"regex": "[a-c]{2,5}"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x" | "yy"'}],
    "tokendance": [{"session": s, "agent": a, "round": r, "mode": m} for s in ("s1", "s2") for a in "ab"
                   for r in (1, 2) for m in MODES],
    "tools": [TOOLS], "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
    "parallel_tool_calls": [False], "logprobs": [True, 2], "top_logprobs": [0, 3], "prompt_logprobs": [0, 2],
    "allowed_token_ids": [[5, 6], [17]], "bad_words": [["a"], ["the end", "x"]], "return_token_ids": [True],
    "return_tokens_as_token_ids": [True], "request_id": ["a-1", "x:y"],
    "truncate_prompt_tokens": [-1, 3, 50], "truncation_side": ["left", "right"],
    "chat_template_kwargs": [{"enable_thinking": False}, {"messages": []}, {"bos_token": "<x>"}],
    "add_generation_prompt": [False], "continue_final_message": [True],
    "logprob_token_ids": [[5, 17], [], [10**9], list(range(130))],
    "repetition_detection": [{"max_pattern_size": 3, "min_count": 2}, {"max_pattern_size": 2, "min_count": 1},
                             {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 3}],
    "thinking_token_budget": [0, 3, -1, -2], "stream_interval": [2, 5, 0], "include_reasoning": [False],
    "return_prompt_text": [True], "use_beam_search": [True], "length_penalty": [0.0, 2.5, -1.0],
}
CONVOS = [[{"role": "user", "content": "hi there"}],
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
          [{"role": "user", "content": "call f"}, {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "3"}]]

# The Responses API's fields (proxy/responses.py)
R_FIELDS = ["instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "stream", "store",
            "previous_response_id", "text", "include", "top_logprobs", "metadata", "reasoning", "truncation",
            "parallel_tool_calls", "tokendance", "top_k", "seed", "stop", "input", "background", "conversation"]
R_PLAUSIBLE: dict[str, Any] = {
    "instructions": ["Be brief.", ""], "tools": [[{"type": "function", "name": "f", "parameters": TOOLS[0]["function"][
        "parameters"]}, {"type": "function", "name": "g", "strict": False}], [{"type": "web_search"}]],
    "tool_choice": ["auto", "none", "required", {"type": "function", "name": "f"}], "max_output_tokens": [1, 5, 0],
    "stream": [True], "store": [False], "previous_response_id": ["resp_nope"], "top_logprobs": [0, 3, 30],
    "text": [{"format": {"type": "json_object"}}, {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"k": {"type": "string"}}}}}, {"format": {"type": "regex"}}],
    "include": [["message.output_text.logprobs"], ["file_search_call.results"]], "metadata": [{"k": "v"}],
    "reasoning": [{"effort": "low"}, {"effort": None}], "truncation": ["auto", "disabled"], "background": [True],
    "conversation": ["conv_nope", {"id": "conv_nope"}],
    "input": [[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], [
        {"role": "user", "content": "call f"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"}], [{"type": "reasoning", "summary": []}]],
} | {k: PLAUSIBLE[k] for k in ("temperature", "top_p", "tokendance", "top_k", "seed", "stop", "parallel_tool_calls")}


# Anthropic's Messages API's (proxy/messages.py)
M_FIELDS = ["system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "stream",
            "stop_sequences", "metadata", "thinking", "output_config", "messages", "tokendance", "cache_salt"]
M_PLAUSIBLE: dict[str, Any] = {
    "system": ["Be brief.", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]],
    "tools": [[{"name": "f", "input_schema": TOOLS[0]["function"]["parameters"]}], [{"name": "g"}],
              [{"type": "web_search_20250305", "name": "web_search"}]],
    "tool_choice": [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"},
                    {"type": "auto", "disable_parallel_tool_use": True}],
    "max_tokens": [1, 6, 0, -3], "stream": [True], "stop_sequences": [["e"], []], "metadata": [{"user_id": "u"}],
    "thinking": [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}],
    "output_config": [{"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
        "k": {"type": "string"}}}}}, {"effort": "low"}],
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}],
        [{"role": "assistant", "content": "Hello"}], [{"role": "user", "content": [{"type": "image", "source": {}}]}]],
    "cache_salt": ["s", ""],
} | {k: PLAUSIBLE[k] for k in ("temperature", "top_p", "tokendance", "top_k")}


# The pooling routes' (proxy/embeddings.py, proxy/scores.py)
P_PLAUSIBLE: dict[str, Any] = {
    "input": ["a b", ["a", "b c"], [5, 6, 7], [[5, 6], [7]], [{"role": "user", "content": "hi"}], []],
    "encoding_format": ["float", "base64", "bytes", "bytes_only", "int8"],
    "embed_dtype": ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int4"], "endianness": ["big", "little", "odd"],
    "truncate_prompt_tokens": [-1, 2, 0], "truncation_side": ["left", "right", "up"], "use_activation": [False],
    "normalize": [True], "dimensions": [8], "add_special_tokens": [False], "cache_salt": ["s", ""],
    "task": ["embed", "classify"], "queries": ["a", ["a", "b"], []], "documents": ["c", ["c", "d", "e"], [{"content": []}]],
    "query": ["a", ["a"], [5, 6], ""], "top_n": [0, 1, -1], "max_tokens_per_doc": [0, 1, 10**6], "text_1": ["a"],
    "text_2": [["b", "c"]],
}
POOLING = {"/v1/embeddings": ["input", "encoding_format", "embed_dtype", "endianness", "truncate_prompt_tokens",
                              "truncation_side", "use_activation", "normalize", "dimensions", "add_special_tokens",
                              "cache_salt"],
           "/pooling": ["input", "encoding_format", "task", "truncation_side"],
           "/score": ["queries", "documents", "text_1", "text_2", "max_tokens_per_doc", "truncate_prompt_tokens"],
           "/rerank": ["query", "documents", "top_n", "max_tokens_per_doc", "use_activation"],
           "/generative_scoring": ["query", "items", "label_token_ids", "apply_softmax", "item_first",
                                   "add_special_tokens", "cache_salt"]}
P_PLAUSIBLE |= {"items": ["b", ["b", "c"], [[5, 6]], [], ["b", [5]], [""]], "apply_softmax": [False],
                "label_token_ids": [[5, 6], [], [10**9], list(range(200)), [-1]], "item_first": [True]}


def pooled(r: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    path = r.choice(list(POOLING))
    b: dict[str, Any] = {"model": model, "input": "a"} if path in ("/v1/embeddings", "/pooling") else \
        {"model": model, "queries": "a", "documents": ["b"]} if path == "/score" else \
        {"model": model, "query": "a", "items": ["b"], "label_token_ids": [5]} if path == "/generative_scoring" else \
        {"model": model, "query": "a", "documents": ["b"]}
    fields = r.sample(POOLING[path], r.randint(1, 3))
    for k in fields:
        b[k] = r.choice(P_PLAUSIBLE[k])
    if r.random() < 0.5:
        b[r.choice(fields)] = wild(r)
    return path, b


def wild(r: random.Random, depth: int = 0) -> Any:
    x = r.random()
    if depth < 2 and x < 0.15:
        return [wild(r, depth + 1) for _ in range(r.randint(0, 3))]
    if depth < 2 and x < 0.3:
        return {r.choice(KEYS): wild(r, depth + 1) for _ in range(r.randint(0, 3))}
    return r.choice(WILD)


def body(r: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    if r.random() < 0.05:  # a conversation object (proxy/conversations.py)
        b = {"items": r.choice(R_PLAUSIBLE["input"]), "metadata": {"k": "v"}}
        if r.random() < 0.5:
            b[r.choice(list(b))] = wild(r)
        return "/v1/conversations", b
    if r.random() < 0.25:
        return response(r, model)
    if r.random() < 0.2:
        return message(r, model)
    if r.random() < 0.15:
        return pooled(r, model)
    chat = r.random() < 0.6
    b: dict[str, Any] = {"model": model, "max_tokens": 6}
    if chat:
        b["messages"] = r.choice(CONVOS)
    else:
        b["prompt"] = r.choice(["Once upon a time", [5, 6, 7, 8], ["a b", "c d"]])
    fields = r.sample(FIELDS, r.randint(1, 5))
    for k in fields:
        b[k] = r.choice(PLAUSIBLE.get(k, [None]))
    if r.random() < 0.5:  # half the bodies have one field gone wild
        b[r.choice(fields)] = wild(r)
    if r.random() < 0.02:
        b["model"] = wild(r)
    if chat and r.random() < 0.15:  # vLLM's batch of chats: the conversation and another
        b["messages"] = [b["messages"], r.choice(CONVOS)]
        return "/v1/chat/completions/batch", b
    return ("/v1/chat/completions" if chat else "/v1/completions"), b


def response(r: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    b: dict[str, Any] = {"model": model, "input": "Name a color.", "max_output_tokens": 6}
    fields = r.sample(R_FIELDS, r.randint(1, 5))
    for k in fields:
        b[k] = r.choice(R_PLAUSIBLE[k])
    if r.random() < 0.5:
        b[r.choice(fields)] = wild(r)
    return "/v1/responses", b


def message(r: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    b: dict[str, Any] = {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": "Name a color."}]}
    fields = r.sample(M_FIELDS, r.randint(1, 5))
    for k in fields:
        b[k] = r.choice(M_PLAUSIBLE[k])
    if r.random() < 0.5:
        b[r.choice(fields)] = wild(r)
    return r.choice(["/v1/messages"] * 4 + ["/v1/messages/count_tokens"]), b


async def fire(http: aiohttp.ClientSession, url: str, path: str, b: dict[str, Any]) -> str | None:
    """None if the answer is as it should be, else what was wrong."""
    async with http.post(url + path, data=json.dumps(b), headers={"Content-Type": "application/json"}) as resp:
        text = (await resp.read()).decode(errors="replace")  # embeddings' bytes too
    if resp.status >= 500 or (resp.status == 200 and ('data: {"error"' in text or "response.failed" in text
                                                      or "event: error" in text)):
        return f"{resp.status} for {json.dumps(b)[:500]}: {text[-300:]}"
    if resp.status == 200 and resp.content_type == "application/octet-stream":
        return None  # encoding_format bytes
    if resp.status >= 400 and path.startswith("/v1/messages"):
        err = json.loads(text)
        if err.get("type") != "error" or set(err.get("error", {})) != {"type", "message"}:
            return f"{resp.status} without Anthropic's error shape for {json.dumps(b)[:300]}: {text[:300]}"
    elif resp.status >= 400:
        err = json.loads(text).get("error", {})
        if set(err) != {"message", "type", "param", "code"} or not err["message"]:
            return f"{resp.status} without OpenAI's error shape for {json.dumps(b)[:300]}: {text[:300]}"
    return None


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_bodies_get_no_5xx(engine_live, seed):
    r = random.Random(seed)
    model = engine_live.backend.info.name
    bodies = [body(r, model) for _ in range(120)]
    gate = asyncio.Semaphore(6)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one(path: str, b: dict[str, Any]) -> str | None:
            async with gate:
                return await fire(http, engine_live.url, path, b)

        wrong = [w for w in await asyncio.gather(*(one(p, b) for p, b in bodies)) if w]
        for _ in range(600):  # background responses run on after their answers
            if not engine_live.server.proxy.running:
                break
            await asyncio.sleep(0.1)
        failed = [r for r in engine_live.server.proxy.stored.items.values() if b'"status":"failed"' in r.body]
        wrong += [f"a background response failed: {r.body[:300]!r}" for r in failed]
        async with http.get(engine_live.url + "/health") as h:
            health = await h.json()
    assert not wrong, "\n".join(wrong[:5])
    assert health["status"] == "ok" and health["in_flight"] == 0
