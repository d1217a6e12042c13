"""AsyncEngine streams: aborts from another task, steps that fail, and close."""

from __future__ import annotations

import asyncio

import pytest

from tokendance.backend.api import BackendError, SamplingParams
from tokendance.backend.async_engine import AsyncEngine, Job
from tokendance.backend.engine import Engine


LONG = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)


async def streaming(stream) -> asyncio.Task:
    """A task consuming `stream`, once its first token has arrived."""
    got: list[int] = []

    async def consume() -> None:
        async for d in stream:
            got.extend(d.token_ids)

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.01)
    return task


async def test_abort_from_another_task_ends_a_waiting_consumer(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)
    core = AsyncEngine(eng)
    stream, other = core.submit([Job("a", list(range(5, 40)), LONG),
                                 Job("b", list(range(7, 30)), SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True))])
    task = await streaming(stream)
    stream.abort()
    await asyncio.wait_for(task, 10)  # it hung here: nothing more arrives for an aborted request
    assert [d.finish_reason async for d in other][-1] == "length"
    await core.close()
    assert eng.pool.num_free == eng.cache.num_blocks


async def test_a_request_that_ended_in_a_failing_step_gets_the_error(tiny_llama, monkeypatch):
    """A step that fails after one of its requests ended (its last delta never sent):
    that request's consumer gets the error too, instead of waiting forever."""
    from tests.backend.test_reuse import round_prompts

    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)
    core = AsyncEngine(eng)
    prefill = eng.collector.prefill

    def pic_fails(group, mode):
        if mode == "pic":
            raise RuntimeError("injected")
        return prefill(group, mode)

    monkeypatch.setattr(eng.collector, "prefill", pic_fails)
    prompts, spans = round_prompts(2, seed=3, hist=20, out=15)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ended, failed = core.submit([Job("ends", prompts[0], one, "collective", spans[0]),
                                 Job("fails", prompts[1], one, "pic", spans[1])])

    async def outcome(stream) -> str:
        try:
            async for _ in stream:
                pass
        except BackendError as e:
            return str(e)
        return "finished"

    got = await asyncio.wait_for(asyncio.gather(outcome(ended), outcome(failed)), 10)
    assert got == ["RuntimeError: injected"] * 2
    monkeypatch.undo()
    again, = core.submit([Job("again", prompts[0], one, "collective", spans[0])])
    assert [d.finish_reason async for d in again] == ["length"]
    await core.close()
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks


async def test_close_ends_every_stream_in_flight_with_an_error(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)
    core = AsyncEngine(eng)
    stream, = core.submit([Job("a", list(range(5, 40)), LONG)])
    task = await streaming(stream)
    await core.close()
    with pytest.raises(BackendError, match="shut down"):
        await asyncio.wait_for(task, 10)  # it hung here: nothing more came
    assert not eng.seqs and eng.pool.num_free == eng.cache.num_blocks
