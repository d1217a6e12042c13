"""AsyncEngine streams: an abort from another task ends a waiting consumer."""

from __future__ import annotations

import asyncio

from tokendance.backend.api import SamplingParams
from tokendance.backend.async_engine import AsyncEngine, Job
from tokendance.backend.engine import Engine


async def test_abort_from_another_task_ends_a_waiting_consumer(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)
    core = AsyncEngine(eng)
    long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    stream, other = core.submit([Job("a", list(range(5, 40)), long),
                                 Job("b", list(range(7, 30)), SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True))])
    got: list[int] = []

    async def consume() -> None:
        async for d in stream:
            got.extend(d.token_ids)

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.01)
    stream.abort()
    await asyncio.wait_for(task, 10)  # it hung here: nothing more arrives for an aborted request
    assert [d.finish_reason async for d in other][-1] == "length"
    await core.close()
    assert eng.pool.num_free == eng.cache.num_blocks
