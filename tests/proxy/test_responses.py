"""OpenAI's Responses API (`/v1/responses`) with the real openai SDK: whole and streamed
(the SDK's own stream accumulator checks the events), conversations by
`previous_response_id`, the store, function tools, reasoning, structured text, sessions,
and every unsupported field a 400; on the real engine, the same tokens as a chat.
Background responses: tests/proxy/test_background.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

MODEL = "fake-tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}
ASK = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'


def prompt(echo) -> str:
    return echo.backend.last_prompt()


def sampling(echo):
    return echo.backend.groups[-1][0].sampling


def test_text_with_instructions(client, echo):
    r = client.responses.create(model=MODEL, input="one two three", instructions="be brief")
    assert (r.object, r.status, r.output_text, r.model) == ("response", "completed", "one two three", MODEL)
    assert r.id.startswith("resp_") and r.completed_at and r.incomplete_details is None
    (msg,) = r.output
    assert (msg.type, msg.role, msg.status, msg.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert prompt(echo) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\none two three<|im_end|>\n"
                            "<|im_start|>assistant\n")
    u = r.usage
    assert u.output_tokens == 3 and u.input_tokens > 3 and u.total_tokens == u.input_tokens + 3
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0


def test_a_priority_reaches_an_engine_that_schedules_by_it(client, echo):
    with pytest.raises(openai.BadRequestError) as e:  # the fake serves first come, first served
        client.responses.create(model=MODEL, input="one two", extra_body={"priority": 2})
    assert (e.value.body["param"], e.value.body["code"]) == ("priority", "unsupported")
    echo.backend.info.priority = True
    try:
        r = client.responses.create(model=MODEL, input="one two", extra_body={"priority": 2})
    finally:
        echo.backend.info.priority = False
    assert r.output_text == "one two" and sampling(echo).priority == 2


def test_a_stream_builds_the_same_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "alpha beta gamma"}]}])
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                             "response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                              "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 3 and "".join(deltas) == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    with client.responses.stream(**kw) as stream:  # the SDK's accumulator checks every event
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.id == events[0].response.id != whole.id


def test_a_conversation_continues_by_previous_response_id(client, echo):
    r1 = client.responses.create(model=MODEL, input="alpha beta", instructions="first rules")
    r2 = client.responses.create(model=MODEL, input="gamma delta", previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    # Instructions do not carry over; the earlier turns do, the answer among them.
    assert prompt(echo) == ("<|im_start|>user\nalpha beta<|im_end|>\n<|im_start|>assistant\nalpha beta<|im_end|>\n"
                            "<|im_start|>user\ngamma delta<|im_end|>\n<|im_start|>assistant\n")
    r3 = client.responses.create(model=MODEL, input="eps", previous_response_id=r2.id, instructions="new")
    assert prompt(echo).startswith("<|im_start|>system\nnew<|im_end|>\n<|im_start|>user\nalpha beta")
    assert prompt(echo).count("<|im_start|>user") == 3 and r3.output_text == "eps"


def test_the_store(client, echo):
    r = client.responses.create(model=MODEL, input="kept here", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.metadata, got.usage.output_tokens) == (r.id, "kept here", {"k": "v"}, 2)
    other = echo.client("sk-other")
    with pytest.raises(openai.NotFoundError, match="not found"):
        other.responses.retrieve(r.id)  # another key's responses are not there
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    gone = client.responses.create(model=MODEL, input="not kept", store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_the_store_evicts_the_least_recently_used(echo, client):
    store = echo.server.proxy.stored
    budget = store.budget
    try:
        store.budget = 10
        small = client.responses.create(model=MODEL, input="small one")
        assert small.id not in store.items  # larger than the whole store: not kept
        store.budget = 10**9
        a = client.responses.create(model=MODEL, input="a a")
        b = client.responses.create(model=MODEL, input="b b")
        store.budget = store.items[a.id].size + store.items[b.id].size + 100  # room for two
        client.responses.retrieve(a.id)  # a was used: b is the least recent
        c = client.responses.create(model=MODEL, input="c c")
        assert list(store.items) == [a.id, c.id]
        assert store.bytes == sum(s.size for s in store.items.values()) <= store.budget
        text = urllib.request.urlopen(echo.url + "/metrics").read().decode()
        assert "tokendance_responses_stored 2\n" in text.replace(".0\n", "\n")
        assert f"tokendance_responses_stored_bytes {store.bytes}" in text
    finally:
        store.budget = budget


def test_function_calls_whole_and_streamed_and_their_output(client, echo):
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER])
    r = client.responses.create(**kw)
    msg, call = r.output
    assert (msg.type, msg.content[0].text) == ("message", "Sure.")
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert sampling(echo).structure.kind == "structural_tag"  # strict unless said otherwise
    client.responses.create(**kw | {"tools": [WEATHER | {"strict": False}]})
    assert sampling(echo).structure is None
    events = list(client.responses.create(**kw, stream=True))
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) > 1 and "".join(args) == call.arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["message", "function_call"] and [e.output_index for e in done] == [0, 1]
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [("message", None), ("function_call", "get_weather")]
    back = client.responses.create(model=MODEL, tools=[WEATHER], previous_response_id=r.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 and sunny"}])
    p = prompt(echo)
    assert '"name": "get_weather"' in p and "<tool_response>\n18 and sunny\n</tool_response>" in p
    assert back.output_text.endswith("18 and sunny </tool_response>")
    # The call as an input item, with the assistant text before it: one assistant turn.
    again = client.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Sure."},
        {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "F"}'},
        {"type": "function_call_output", "call_id": "c9", "output": "cold"}])
    assert prompt(echo).count("<|im_start|>assistant") == 2 and again.status == "completed"


def test_a_named_function_and_required(client, echo):
    r = client.responses.create(model=MODEL, input='{"city": "Rome", "unit": "F"}', tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Rome", "unit": "F"}
    assert sampling(echo).structure.kind == "json"


def test_reasoning(client):
    r = client.responses.create(model=MODEL, input="<think> a b </think> c d")
    think, msg = r.output
    assert think.type == "reasoning" and think.id.startswith("rs_") and think.content[0].text == " a b "
    assert msg.content[0].text == " c d"
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # <think>, a, b: before the content began
    # Strict tools hold only their calls: the text around them, the thinking too, is free.
    r = client.responses.create(model=MODEL, input="<think> a b </think> " + ASK, tools=[WEATHER])
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.tools[0].strict
    events = list(client.responses.create(model=MODEL, input="<think> a b </think> c d", stream=True))
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == " a b "


def test_max_output_tokens_leaves_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="a b c d e", max_output_tokens=2)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", "a b ")
    assert r.output[0].status == "incomplete" and r.completed_at is None
    events = list(client.responses.create(model=MODEL, input="a b c d e", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"


def test_text_formats_and_sampling(client, echo):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(model=MODEL, input="x", temperature=0.5, top_p=0.9,
                            text={"format": {"type": "json_schema", "name": "A", "schema": schema}})
    sp = sampling(echo)
    assert (sp.structure.kind, json.loads(sp.structure.spec), sp.temperature, sp.top_p) == ("json", schema, 0.5, 0.9)
    client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}},
                            extra_body={"top_k": 5, "seed": 7})
    sp = sampling(echo)
    assert (sp.structure.kind, sp.top_k, sp.seed) == ("json_object", 5, 7)


def test_logprobs(client):
    r = client.responses.create(model=MODEL, input="u v", include=["message.output_text.logprobs"], top_logprobs=2)
    lp = r.output[0].content[0].logprobs
    assert [t.token for t in lp] == ["u ", "v"] and all(len(t.top_logprobs) == 2 for t in lp)
    assert client.responses.create(model=MODEL, input="u v").output[0].content[0].logprobs is None
    # The thinking's tokens are not the message's (the one that ends it brings content)
    r = client.responses.create(model=MODEL, input="<think> a b </think> c d", include=["message.output_text.logprobs"])
    assert [t.token for t in r.output[1].content[0].logprobs] == ["</think> ", "c ", "d"]


def test_a_conversation_stays_in_its_session(client):
    kw = dict(model=MODEL, extra_body={"tokendance": {"session": "resp-s", "agent": "Ada"}})
    first = client.responses.with_raw_response.create(input="one", **kw)
    assert (first.headers["X-TokenDance-Session"], first.headers["X-TokenDance-Round"]) == ("resp-s", "1")
    nxt = client.responses.with_raw_response.create(model=MODEL, input="two", previous_response_id=first.parse().id)
    h = nxt.headers
    assert (h["X-TokenDance-Session"], h["X-TokenDance-Agent"], h["X-TokenDance-Round"]) == ("resp-s", "Ada", "2")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "x"},  # checked as a message: named as the input
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input"),
    ({"background": True, "store": False}, "store"),
    ({"conversation": 5}, "conversation"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "middle"}, "truncation"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [WEATHER | {"name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"temperature": -1}, "temperature"),
    ({"input": 5}, "input"),
])
def test_what_it_cannot_do_is_a_400(echo, body, param):
    data = json.dumps({"model": MODEL, "input": "hi"} | body).encode()
    req = urllib.request.Request(echo.url + "/v1/responses", data=data, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == param and err["message"], err


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def test_on_the_engine_a_response_is_the_chats_answer(engine_client, engine_model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    chat = engine_client.chat.completions.create(model=engine_model, messages=msgs, max_tokens=12, temperature=0)
    r = engine_client.responses.create(model=engine_model, instructions="Be brief.", input="Name three colours.",
                                       max_output_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


async def test_an_engine_failure_mid_stream_is_response_failed(start, make_backend):
    be = make_backend(fail="stream")
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    events = [e async for e in await c.responses.create(model=MODEL, input="a b c", stream=True)]
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "engine_error" and "engine error" in last.response.error.message
    with pytest.raises(openai.InternalServerError):
        await c.responses.create(model=MODEL, input="a b c")
    assert server.proxy.stored.items == {}  # a failed response is not stored
    be.fail = None
    assert (await c.responses.create(model=MODEL, input="a b c")).output_text == "a b c"
    await c.close()


async def test_a_client_gone_mid_stream_frees_the_engines_kv(start, make_backend, until):
    import aiohttp

    be = make_backend(length=30, delay=0.02)
    server = await start(be)
    words = " ".join(f"w{i}" for i in range(30))
    async with aiohttp.ClientSession() as http:
        r = await http.post(server.url + "/v1/responses", json={"model": MODEL, "input": words, "stream": True})
        await r.content.readline()  # the stream began
        r.close()
    await until(lambda: be.aborted and not be.active)
    assert server.proxy.stored.items == {}  # nor is one its client left


def test_a_stored_responses_input_items(client, echo):
    r = client.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "F"}'},
        {"type": "function_call_output", "call_id": "c9", "output": "cold"}])
    page = client.responses.input_items.list(r.id)  # the newest first
    assert [i.type for i in page.data] == ["function_call_output", "function_call", "message"]
    msg = page.data[-1]
    assert (msg.role, msg.content[0].type, msg.content[0].text, msg.id[:4]) == ("user", "input_text", "weather?", "msg_")
    assert (page.data[0].output, page.data[1].name) == ("cold", "get_weather") and not page.has_more
    first = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.type for i in first.data] == ["message"] and first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=first.data[0].id, limit=5)
    assert [i.type for i in rest.data] == ["function_call", "function_call_output"] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(r.id, order="asc")] == \
        [first.data[0].id, *(i.id for i in rest.data)]  # the SDK pages through them too
    text = client.responses.create(model=MODEL, input="just text")
    (only,) = client.responses.input_items.list(text.id).data
    assert only.content[0].text == "just text"
    for bad in ({"limit": 0}, {"order": "up"}, {"after": "msg_x"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.input_items.list(r.id, **bad)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
