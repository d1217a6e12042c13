"""vLLM's --max-logprobs: the most alternatives a token's logprobs list (chat's
top_logprobs, a completion's logprobs, prompt_logprobs), 20 unless the server says
otherwise, -1 up to the vocabulary; past it a 400 naming the field and the flag."""

from __future__ import annotations

import argparse

import msgspec
import openai
import pytest

from tokendance.backend import endpoint, wire
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.flags import add_engine_args, engine_options
from tokendance.backend.service import EngineBackend

from .conftest import Threaded

MSGS = [{"role": "user", "content": "Count."}]


def served(model, **kw) -> Threaded:
    return Threaded(EngineBackend.load(str(model), dtype="float32", mode="full", kv_tokens=1024, **kw))


def refused(call, param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


def test_twenty_unless_the_server_says_otherwise_as_in_vllm(tiny_llama):
    t = served(tiny_llama)
    try:
        c, name = t.client(), t.backend.info.name
        text = c.completions.create(model=name, prompt="Count.", max_tokens=2, logprobs=10)  # OpenAI stops at 5
        assert [len(x) for x in text.choices[0].logprobs.top_logprobs] == [10, 10]
        refused(lambda: c.completions.create(model=name, prompt="Count.", max_tokens=2, logprobs=21), "logprobs",
                "logprobs must be between 0 and 20 (the server's --max-logprobs)")
        refused(lambda: c.chat.completions.create(model=name, messages=MSGS, max_tokens=2, logprobs=True,
                                                  top_logprobs=21), "top_logprobs", "between 0 and 20")
    finally:
        t.close()


def test_the_servers_limit_bounds_every_kind(tiny_llama):
    t = served(tiny_llama, max_logprobs=30)
    try:
        c, name = t.client(), t.backend.info.name
        chat = c.chat.completions.create(model=name, messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=25,
                                         extra_body={"prompt_logprobs": 30})
        assert [len(x.top_logprobs) for x in chat.choices[0].logprobs.content] == [25, 25]
        assert all(len(p) >= 30 for p in chat.prompt_logprobs[1:])  # the prompt token's own beside its best 30
        refused(lambda: c.chat.completions.create(model=name, messages=MSGS, max_tokens=2,
                                                  extra_body={"prompt_logprobs": 31}),
                "prompt_logprobs", "between 0 and 30")
        assert msgspec.json.decode(msgspec.json.encode(endpoint.engine_info(t.backend)), type=wire.Info
                                   ).max_logprobs == 30  # what a proxy in front of `tokendance engine` reads
    finally:
        t.close()


def test_minus_one_goes_up_to_the_vocabulary(make_model):
    t = served(make_model("llama", vocab_size=2048), max_logprobs=-1)
    try:
        c, name = t.client(), t.backend.info.name
        ids = [5, 6, 7]  # the model's vocabulary is SmolLM2's first 2048 tokens
        text = c.completions.create(model=name, prompt=ids, max_tokens=1, logprobs=2048,
                                    extra_body={"return_tokens_as_token_ids": True})  # texts repeat, ids do not
        assert len(text.choices[0].logprobs.top_logprobs[0]) == 2048
        refused(lambda: c.completions.create(model=name, prompt=ids, max_tokens=1, logprobs=2049),
                "logprobs", "logprobs must be between 0 and 2048")
        with pytest.raises(InvalidRequest, match="top_logprobs must be at most the vocabulary's 2048"):
            t.backend.engine.check(ids, SamplingParams(logprobs=True, top_logprobs=2049))  # the engine's own API
    finally:
        t.close()


def test_the_flag():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    assert engine_options(p.parse_args(["--max-logprobs", "-1"]))["max_logprobs"] == -1
    assert engine_options(p.parse_args([]))["max_logprobs"] == 20
    with pytest.raises(argparse.ArgumentError, match="must be at least -1, got -2"):
        p.parse_args(["--max-logprobs", "-2"])
