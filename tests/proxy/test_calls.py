"""Tool calls read out of a choice's text (proxy/calls.py) and the request side
(proxy/tools.py): any split of a text reads as the whole does, text that holds no call
comes back exactly, and every malformed tool field is a 400 naming it."""

from __future__ import annotations

import json
import random

import pytest

from tokendance.proxy import calls, scan, tools
from tokendance.proxy.errors import ApiError

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {  # text, then (content, [(name, arguments)]) or None: no call, all of it content
    "plain": ("Hello there, plain text.  \n", None),
    "before": ("Let me check.\n" + CALL + "\n", ("Let me check.", [("get_weather", '{"city": "Paris"}')])),
    "two": ('<tool_call>{"name":"a","arguments":{}}</tool_call>\n\n<tool_call>{"name":"b","arguments":{"x":[1,2]}}'
            "</tool_call>\n Done.", ("Done.", [("a", "{}"), ("b", '{"x":[1,2]}')])),  # as written: streamed
    "not json": ("Broken \n<tool_call>{name: oops}</tool_call> end", None),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', None),
    "unclosed": ('cut <tool_call>{"name":"a","arguments":{"q":"<tool_call>"}}',
                 ("cut", [("a", '{"q":"<tool_call>"}')])),
    "cut args": ('<tool_call>{"name": "a", "arguments": {"q": "Par', ("", [("a", '{"q": "Par')])),
    "closing tag in an argument": ('<tool_call>{"name":"a","arguments":{"q":"</tool_call>"}}</tool_call> ok',
                                   ("ok", [("a", '{"q":"</tool_call>"}')])),
    "arguments first": ('<tool_call>{"arguments": {"k":1}, "name": "f"}</tool_call>', ("", [("f", '{"k": 1}')])),
    "escaped name": ('<tool_call>{"name": "f\\u0031", "arguments": {}}</tool_call>', ("", [("f1", "{}")])),
    "cut": ('cut <tool_call>{"name":"a","argu', None),
    "tag-like": ("a < b and <tool but not <tool_cal", None),
    "string args": ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>',
                    ("", [("f", '{"k": 1}')])),
    "unicode": ('Voilà <tool_call>{"name": "f", "arguments": {"ville": "Zürich"}}</tool_call>',
                ("Voilà", [("f", '{"ville": "Zürich"}')])),
}


def read(reader: calls.Reader, text: str, rng: random.Random | None = None) -> calls.Parsed:
    out, i = calls.Parsed(), 0
    while i < len(text):
        k = rng.randint(1, 7) if rng else len(text)
        out.add(*reader.feed(text[i:i + k]))
        i += k
    out.add(*reader.end())
    return out


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TEXTS = {  # as TEXTS, for the Llama 3 reader: a whole answer of calls, or content
    "plain": ("The weather is fine.  \n", None),
    "one": ("  " + LLAMA + "\n", ("", [("get_weather", '{"city": "Paris"}')])),
    "two": (LLAMA + '; {"name": "b", "arguments": {"x": [1, 2]}}', ("", [("get_weather", '{"city": "Paris"}'),
                                                                        ("b", '{"x": [1, 2]}')])),
    "json answer": ('{"city": "Paris", "weather": "sunny"}', None),
    "text after": (LLAMA + " and then I will tell you", ("and then I will tell you",
                                                        [("get_weather", '{"city": "Paris"}')])),
    "cut args": ('{"name": "a", "parameters": {"q": "Par', ("", [("a", '{"q": "Par')])),
    "parameters first": ('{"parameters": {"k":1}, "name": "f"}', ("", [("f", '{"k": 1}')])),  # read whole
    "streamed, then whole": (LLAMA + '; {"parameters": {}, "name": "g"}', ("", [("get_weather", '{"city": "Paris"}'),
                                                                               ("g", "{}")])),
    "streamed, then not a call": (LLAMA + '; {"x": 1}', ('{"x": 1}', [("get_weather", '{"city": "Paris"}')])),
    "cut": ('{"name": "get_weather", "param', None),
    "text first": ("Let me call: " + LLAMA, None),
    "whitespace": (" \n ", None),
}


READS = [(calls.Hermes, n, *TEXTS[n]) for n in TEXTS] + [(calls.Llama3, n, *LLAMA_TEXTS[n]) for n in LLAMA_TEXTS]


@pytest.mark.parametrize("make,name,text,want", READS, ids=[f"{m.__name__}-{n}" for m, n, _, _ in READS])
def test_every_split_reads_as_the_whole(make, name, text, want):
    content, named = want if want is not None else (text, [])
    rng = random.Random(name)
    for trial in range(300):
        got = read(make(), text, rng if trial else None)
        assert got.content == content
        assert [(c.name, c.arguments) for c in got.calls] == named
        assert [c.index for c in got.calls] == list(range(len(named)))
        assert all(c.id.startswith("call_") for c in got.calls)
    assert len({c.id for c in got.calls}) == len(named)


def test_llama3_streams_text_at_once_and_keeps_the_first_call_without_parallel_calls():
    r = calls.Llama3()
    assert r.feed(" \n") == ("", []) and r.feed("Hi") == (" \nHi", []) and r.feed(" {x") == (" {x", [])
    one = read(calls.Llama3(parallel=False), LLAMA + ";" + LLAMA)
    assert [c.name for c in one.calls] == ["get_weather"] and one.content == ""
    assert calls.reader(tools.Tools([], "auto", dialect=tools.LLAMA3)).__class__ is calls.Llama3
    assert calls.reader(tools.Tools([], "auto", dialect=tools.HERMES)).__class__ is calls.Hermes


def test_llama3_streams_a_calls_parameters_as_they_come():
    r = calls.Llama3()
    assert r.feed(' {"name": "get_weather", "param') == ("", [])
    content, pieces = r.feed('eters": {"city": "Pa')
    assert content == "" and [(p.index, p.name, p.arguments) for p in pieces] == [(0, "get_weather", '{"city": "Pa')]
    content, pieces = r.feed('ris"}}; {"name": "b", "parameters": {}}')
    assert [(p.index, p.name, p.arguments) for p in pieces] == [(0, None, 'ris"}'), (1, "b", "{}")]
    assert r.end() == ("", [])


def test_hermes_hands_content_on_as_soon_as_it_cannot_be_a_call():
    r = calls.Hermes()
    assert r.feed("Hello <to") == ("Hello", [])  # the space and "<to" may precede a call
    assert r.feed("day") == (" <today", [])
    assert r.feed(" <tool_call>{") == ("", [])
    content, pieces = r.feed('"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [p.name for p in pieces] == ["f"]
    assert r.end() == ("", [])


def test_hermes_streams_a_calls_arguments_as_they_come():
    r = calls.Hermes()
    assert r.feed('Hi <tool_call>\n{"name": "get_weather", "argu') == ("Hi", [])
    content, pieces = r.feed('ments": {"city": "Pa')
    assert content == "" and [(p.index, p.name, p.arguments) for p in pieces] == [(0, "get_weather", '{"city": "Pa')]
    assert pieces[0].id.startswith("call_")
    content, pieces = r.feed('ris"}}\n</tool_call>\n')
    assert [(p.index, p.id, p.name, p.arguments) for p in pieces] == [(0, None, None, 'ris"}')]
    assert r.end() == ("", [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    got = read(calls.Hermes(parallel=False), TEXTS["two"][0])
    assert [c.name for c in got.calls] == ["a"] and got.content == "Done."


def test_a_named_function_streams_its_arguments():
    r = calls.Named("f")
    first = r.feed('{"a"')
    assert first[0] == "" and [(p.index, p.name, p.arguments) for p in first[1]] == [(0, "f", '{"a"')]
    assert first[1][0].id.startswith("call_")
    rest = r.feed(": 1}")
    assert [(p.index, p.id, p.name, p.arguments) for p in rest[1]] == [(0, None, None, ": 1}")]
    assert r.end() == ("", [])
    empty = calls.Named("f").whole("")  # max_tokens cut before a token: still the call
    assert [(c.name, c.arguments) for c in empty.calls] == [("f", "")]


def test_required_gives_the_calls_it_completed():
    whole = calls.Required().whole('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in whole.calls] == [("f", '{"a": 1}'), ("g", "{}")]
    cut = calls.Required().whole('[{"name":"f","parameters":{"a":1}},{"name":"g","para')
    assert [(c.name, c.arguments) for c in cut.calls] == [("f", '{"a": 1}')] and cut.content == ""
    spaced = calls.Required().whole('\n[ \n {"name": "f", "parameters": {}} ,\n{"name": "g", "parameters": {}} ]')
    assert [c.name for c in spaced.calls] == ["f", "g"]
    nothing = calls.Required().whole('[{"na')
    assert nothing.calls == [] and nothing.content == '[{"na'


def test_finish_reasons_as_openai_gives_them():
    auto = calls.Hermes()
    read(auto, CALL)
    assert calls.finish(auto, "stop") == "tool_calls" and calls.finish(auto, "length") == "length"
    assert calls.finish(calls.Hermes(), "stop") == "stop"
    named = calls.Named("f")
    read(named, "{}")
    assert calls.finish(named, "stop") == "stop"


WEATHER = tools.Tool(type="function", function=tools.Function(
    name="get_weather", description="Weather of a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))


def named(name: str) -> tools.NamedChoice:
    return tools.NamedChoice(type="function", function=tools.FunctionName(name))


@pytest.mark.parametrize("given,param", [
    (([], "required", None), "tool_choice"),
    (([tools.Tool(type="custom")], None, None), "tools[0].type"),
    (([tools.Tool(type="function")], None, None), "tools[0].function"),
    (([tools.Tool(type="function", function=tools.Function(name="has space"))], None, None),
     "tools[0].function.name"),
    (([WEATHER, WEATHER], None, None), "tools[1].function.name"),
    (([WEATHER], "sometimes", None), "tool_choice"),
    (([WEATHER], named("get_time"), None), "tool_choice.function.name"),
    (([WEATHER], tools.NamedChoice(type="tool", function=tools.FunctionName("get_weather")), None),
     "tool_choice.type"),
])
def test_malformed_tools_are_400s_naming_the_field(given, param):
    with pytest.raises(ApiError) as e:
        tools.check(*given)
    assert e.value.status == 400 and e.value.body.param == param


def test_choices_and_the_schemas_they_hold_the_output_to():
    assert tools.check(None, None, None) is None and tools.check([], "none", None) is None
    auto = tools.check([WEATHER], None, None)
    assert auto.choice == "auto" and auto.structure() is None
    assert auto.specs[0]["function"]["parameters"]["required"] == ["city"]
    one = tools.check([WEATHER], named("get_weather"), None).structure()
    assert json.loads(one.spec) == WEATHER.function.parameters and not one.whitespace
    req = tools.check([WEATHER], "required", False).structure()
    schema = json.loads(req.spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and req.param == "tools"
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}


def test_required_lifts_each_tools_defs_to_the_root():
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
           "$defs": {"P": {"type": "integer"}}}
    fn = lambda name, params: tools.Tool(type="function", function=tools.Function(  # noqa: E731
        name=name, parameters=params))
    ok = json.loads(tools.check([fn("a", ref), fn("b", ref)], "required", None).structure().spec)
    assert ok["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in ok["items"]["anyOf"][0]["properties"]["parameters"]
    other = {**ref, "$defs": {"P": {"type": "string"}}}
    with pytest.raises(ApiError) as e:
        tools.check([fn("a", ref), fn("b", other)], "required", None).structure()
    assert e.value.body.param == "tools"


def test_a_conversation_written_for_a_template_without_tools():
    t = tools.check([WEATHER], None, None)
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": tools.made_calls(2, [
            tools.MadeCall(id="c1", function=tools.CalledFunction(name="get_weather",
                                                                  arguments='{"city": "Paris"}')),
            tools.MadeCall(function=tools.CalledFunction(name="get_weather", arguments={"city": "Rome"}))])},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ]
    out = tools.hermes(convo, t)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[0]["content"].startswith("# Tools") and out[0]["content"].endswith("</tool_call>\n\nBe brief.")
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == (tools.call_text("get_weather", {"city": "Paris"}) + "\n"
                                 + tools.call_text("get_weather", {"city": "Rome"}))
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    assert all(set(m) <= {"role", "content", "name", "tool_call_id"} for m in out)
    bare = tools.hermes([{"role": "user", "content": "hi"}], t)
    assert bare[0]["role"] == "system" and bare[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"text"'])
def test_a_made_call_whose_arguments_are_not_an_object_is_a_400(arguments):
    with pytest.raises(ApiError) as e:
        tools.made_calls(3, [tools.MadeCall(function=tools.CalledFunction(name="f", arguments=arguments))])
    assert e.value.body.param == "messages[3].tool_calls[0].function.arguments"


@pytest.mark.parametrize("body,want", [
    ('{"name": "f", "arguments": {"a": 1}}', ("f", 27)), (' \n{ "name":"f" ,"arguments" : {', ("f", 30)),
    ('{"name": "f', None), ('{"na', None), ("", None), ('{"name": "f", "arguments": ', None),
    ('{"arguments": {}}', False), ('{"name": 5', False), ('{"name": "f", "arguments": "x', False),
    ('[{"name"', False), ('{"name": "\\q", "arguments": {', False),
])
def test_a_hermes_body_begins_as_a_streamed_call_or_not(body, want):
    assert scan.head(body) == want


def test_a_scan_ends_where_its_value_closes():
    s = scan.Scan()
    assert s.feed('{"a": "}\\"", ') == 13 and not s.done
    assert s.feed('"b": [1, {}]} tail') == 13 and s.done
    string = scan.Scan()
    assert string.feed('"a\\"b", x') == 6 and string.done  # a string closes at its quote
