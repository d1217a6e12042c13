"""Structured outputs through the proxy with the openai SDK: response_format (json_object,
json_schema, structural_tag, the SDK's parse() of a pydantic model) and vLLM's structured_outputs
(json, regex, choice, grammar, structural_tag), whole and streamed, in a session's round; a spec that
does not compile is a 400 naming the field, before any work."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pydantic
import pytest

from tokendance.backend.service import EngineBackend

from .conftest import Threaded

PLAN = {"type": "object", "additionalProperties": False, "required": ["move", "steps"],
        "properties": {"move": {"enum": ["north", "south"]}, "steps": {"type": "integer"}}}




def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def plan_ok(text: str) -> bool:
    v = json.loads(text)
    return set(v) == {"move", "steps"} and v["move"] in ("north", "south") and type(v["steps"]) is int


def test_a_json_schema_whole_and_streamed(engine_client, engine_model):
    # The tiny random model would write whitespace forever where JSON allows any.
    so = {"structured_outputs": {"json": PLAN, "disable_any_whitespace": True}}
    kw = dict(model=engine_model, messages=user("Where to?"), max_tokens=200, temperature=0, extra_body=so)
    whole = engine_client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and plan_ok(text), text
    chunks = list(engine_client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    plain = engine_client.chat.completions.create(**{**kw, "extra_body": None})
    assert plain.choices[0].message.content != text


@pytest.mark.parametrize("so,ok", [
    ({"regex": "[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    ({"choice": ["buy", "sell", "hold"]}, lambda t: t in ("buy", "sell", "hold")),
    ({"grammar": 'root ::= ("ab" | "cd") [0-9]'}, lambda t: re.fullmatch("(ab|cd)[0-9]", t)),
], ids=["regex", "choice", "grammar"])
def test_vllms_structured_outputs_in_chat_and_completions(engine_client, engine_model, so, ok):
    chat = engine_client.chat.completions.create(model=engine_model, messages=user("Now?"), max_tokens=50, n=2,
                                          temperature=1.0, seed=3, extra_body={"structured_outputs": so})
    text = engine_client.completions.create(model=engine_model, prompt="The answer:", max_tokens=50, temperature=0,
                                     extra_body={"structured_outputs": so})
    for c in [*chat.choices, *text.choices]:
        got = c.message.content if hasattr(c, "message") else c.text
        assert c.finish_reason == "stop" and ok(got), got


# Every part forced, so the tiny random model's answer shows the tag held it.
SEQUENCE = {"type": "sequence", "elements": [
    {"type": "const_string", "value": "At "},
    {"type": "tag", "begin": "<t>", "content": {"type": "regex", "pattern": "[0-2][0-9]:[0-5][0-9]"}, "end": "</t>"}]}


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "structural_tag", "format": SEQUENCE}},
    {"extra_body": {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": SEQUENCE}}}},
], ids=["response_format", "structured_outputs"])
def test_a_structural_tag_holds_the_output(engine_client, engine_model, kw):
    got = engine_client.chat.completions.create(model=engine_model, messages=user("When?"), max_tokens=30,
                                                temperature=0, **kw)
    c = got.choices[0]
    assert c.finish_reason == "stop" and re.fullmatch("At <t>[0-2][0-9]:[0-5][0-9]</t>", c.message.content), c


def test_json_object_with_a_length_cut_reports_length(engine_client, engine_model):
    r = engine_client.chat.completions.create(model=engine_model, messages=user("JSON please."), max_tokens=4,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


async def test_structured_requests_join_a_round(engine_live, engine_model):
    c = openai.AsyncOpenAI(base_url=engine_live.url + "/v1", api_key="sk-test", max_retries=0)

    async def turn(agent: str):
        return await c.chat.completions.with_raw_response.create(
            model=engine_model, messages=user(f"{agent}, where to?"), max_tokens=200, temperature=0,
            extra_body={"structured_outputs": {"json": PLAN, "disable_any_whitespace": True},
                        "tokendance": {"session": "structured", "agent": agent, "round": 1}})

    raws = await asyncio.gather(*(turn(a) for a in ("ann", "bob", "cy")))
    assert {r.headers["X-TokenDance-Group"] for r in raws} == {"3"}
    assert all(plan_ok(r.parse().choices[0].message.content) for r in raws)


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a["}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"json": "{nope"}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"structural_tag": {"type": "nope"}}}},
     "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                              "content": {"type": "regex", "pattern": "["}}}},
     "response_format.format"),
], ids=["schema", "regex", "json-text", "grammar", "structural-tag", "tag-format"])
def test_a_spec_that_does_not_compile_is_a_400(engine_client, engine_model, engine_live, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        engine_client.chat.completions.create(model=engine_model, messages=user("hi"), max_tokens=5, **kw)
    err = e.value.body
    assert err["param"] == param and "/project/" not in err["message"]
    assert not engine_live.backend.engine.seqs  # refused before the engine saw it


class Verdict(pydantic.BaseModel):
    guilty: bool
    reason: str
    years: int


@pytest.mark.slow
def test_the_sdks_parse_gives_a_pydantic_object_on_smollm2(smollm2):
    """The real model, with the SDK's own helper: the schema of a pydantic model, strict."""
    t = Threaded(EngineBackend.load(str(smollm2), dtype="float32", mode="full"))
    try:
        c = t.client()
        kw = dict(model=t.backend.info.name, temperature=0, max_tokens=120, messages=user(
            "The defendant stole a bike. Give a verdict as JSON with guilty, reason, years."))
        r = c.chat.completions.parse(**kw, response_format=Verdict)
        assert isinstance(r.choices[0].message.parsed, Verdict) and r.choices[0].finish_reason == "stop"
        free = c.chat.completions.create(**kw)
        with pytest.raises(pydantic.ValidationError):  # unconstrained, it does not keep to the schema
            Verdict.model_validate_json(free.choices[0].message.content)
    finally:
        t.close()

