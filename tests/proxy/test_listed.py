"""Granite's and Phi-4-mini's tool calls (vLLM's `--tool-call-parser granite` and
`phi4_mini_json`): a JSON list of calls after a marker, read whole whatever pieces the
text comes in; an answer without the marker streams as content."""

from __future__ import annotations

import json

import pytest

from tokendance.proxy import tools
from tokendance.proxy.calls import Parsed
from tokendance.proxy.listed import Listed

from .test_tools import TIME, WEATHER, gathered, user

GRANITE, PHI4 = tools.MARKERS[tools.GRANITE], tools.MARKERS[tools.PHI4]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
UTC = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def read(markers: tuple[str, ...], text: str, parallel: bool = True) -> tuple[Parsed, Parsed, str]:
    """The text read whole, read a character at a time, and what the first feed gave."""
    whole = Listed(markers, parallel).whole(text)
    r, bits, first = Listed(markers, parallel), Parsed(), None
    for ch in text:
        out = r.feed(ch)
        first = out[0] if first is None else first
        bits.add(*out)
    bits.add(*r.end())
    return whole, bits, first or ""


@pytest.mark.parametrize("markers,text,content,calls", [
    (GRANITE, f"<|tool_call|>[{PARIS}, {UTC}]", "", ["get_weather", "get_time"]),
    (GRANITE, '  <tool_call>[{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]', "", ["get_time"]),
    (GRANITE, f"<|tool_call|>[{PARIS}]<|tool_call|>[{UTC}]", "", ["get_weather", "get_time"]),  # strict: a list a call
    (PHI4, f"functools[{UTC}] Asked.", "Asked.", ["get_time"]),
    (PHI4, "func", "func", []),  # a marker's beginning that stayed one
    (GRANITE, "<|tool_call|>[{bad json", "<|tool_call|>[{bad json", []),  # stays as the model wrote it
    (GRANITE, '<|tool_call|>[{"arguments": {}}]', '<|tool_call|>[{"arguments": {}}]', []),  # no name: no call
    (PHI4, "Sunny, 21 C.", "Sunny, 21 C.", []),
])
def test_a_marker_and_its_list_are_calls_in_any_pieces(markers, text, content, calls):
    whole, bits, _ = read(markers, text)
    for got in (whole, bits):
        assert got.content == content and [c.name for c in got.calls] == calls
    assert [(c.id, c.arguments) for c in whole.calls] != [] or not calls
    assert [c.arguments for c in whole.calls] == [c.arguments for c in bits.calls]
    if calls and calls[0] == "get_time":
        assert json.loads(whole.calls[0].arguments) == {"zone": "UTC"}


def test_text_streams_at_once_and_one_call_without_parallel():
    assert read(PHI4, "Sunny, 21 C.")[2] == "S"  # given as it comes, not held to the end
    whole, _, _ = read(GRANITE, f"<|tool_call|>[{PARIS}, {UTC}]", parallel=False)
    assert [c.name for c in whole.calls] == ["get_weather"]


def test_through_the_proxy_whole_and_streamed(echo, client):
    """The fake backend echoes the question: its answer is the call."""
    px = echo.server.proxy
    px._dialect = tools.GRANITE
    try:
        kw = dict(model="fake-tiny", messages=user(f"<|tool_call|>[{PARIS}]"), tools=[WEATHER, TIME])
        ch = client.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
            ("get_weather", {"city": "Paris", "unit": "C"})]
        content, calls, finish = gathered(client.chat.completions.create(**kw, stream=True))
        assert (content, finish) == ("", "tool_calls") and [n for _, n, _ in calls] == ["get_weather"]
    finally:
        px._dialect = None


def test_the_parsers_need_a_template_that_renders_tools():
    plain = lambda messages, tools=None: "".join(m["content"] for m in messages)  # noqa: E731
    for parser in ("granite", "phi4_mini_json"):
        with pytest.raises(ValueError, match=f"--tool-call-parser {parser}: the chat template renders no tools"):
            tools.dialect(plain, parser)
    renders = lambda messages, tools=None: json.dumps(tools) + messages[0]["content"]  # noqa: E731
    assert tools.dialect(renders, "granite") == tools.GRANITE and tools.dialect(renders, "phi4_mini_json") == tools.PHI4
