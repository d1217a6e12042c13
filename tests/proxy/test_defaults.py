"""A request that leaves its sampling out samples with the model's defaults
(ModelInfo.sampling: backend/generation.py), through the proxy to the engine."""

from __future__ import annotations

import openai

from .conftest import Threaded
from .fake_backend import FakeBackend


def test_a_request_samples_with_what_the_engine_advertises(tiny_llama):
    """The engine reads --override-generation-config; a chat that leaves temperature and
    its length out gets the engine's; one that sets them keeps its own."""
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="full",
                            override_generation_config={"temperature": 0.0, "max_new_tokens": 5})
    assert be.info.sampling == {"temperature": 0.0, "max_tokens": 5}
    t = Threaded(be)
    try:
        c, name = t.client(), be.info.name
        msgs = [{"role": "user", "content": "Count."}]
        a, b = (c.chat.completions.create(model=name, messages=msgs, extra_body={"ignore_eos": True})
                for _ in range(2))
        assert a.usage.completion_tokens == 5 and a.choices[0].message.content == b.choices[0].message.content
        own = c.chat.completions.create(model=name, messages=msgs, max_tokens=7, temperature=1.0, seed=1,
                                        extra_body={"ignore_eos": True})
        assert own.usage.completion_tokens == 7
        text = c.completions.create(model=name, prompt="Count.", extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 5  # the model's length, under the completions' 16
    finally:
        t.close()


async def test_the_model_defaults_fill_only_what_a_request_leaves_out(start):
    be = FakeBackend()
    be.info.sampling = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                        "max_tokens": 300}
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    msgs = [{"role": "user", "content": "hello there"}]

    def sent() -> tuple:
        sp = be.groups[-1][0].sampling
        return sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens

    await c.chat.completions.create(model="fake-tiny", messages=msgs)
    assert sent() == (0.7, 0.8, 20, 0.0, 1.05, 300)
    await c.chat.completions.create(model="fake-tiny", messages=msgs, temperature=0, top_p=1, max_tokens=9,
                                    extra_body={"top_k": 0, "min_p": 0.1, "repetition_penalty": 1.0})
    assert sent() == (0, 1, 0, 0.1, 1.0, 9)
    await c.chat.completions.create(model="fake-tiny", messages=msgs, extra_body={"top_k": -1})
    assert sent()[2] == 0  # vLLM's -1: off
    await c.completions.create(model="fake-tiny", prompt="hello there")
    assert sent()[-1] == 16  # the completions' default, shorter than the model's
    await c.responses.create(model="fake-tiny", input="hello there", temperature=0.2)
    assert sent() == (0.2, 0.8, 20, 0.0, 1.05, 300)
