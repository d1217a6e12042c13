"""Background responses of the Responses API with the real openai SDK: read back when
done, cancelled, failed, drained at shutdown, and streamed: followed by the request that
made them, left and resumed from an event's sequence number (proxy/feed.py)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tokendance.proxy.feed import Feed

MODEL = "fake-tiny"
WORDS = " ".join(f"w{i}" for i in range(30))


@pytest.fixture
async def sdk(start, make_backend):
    """(server, backend, client) with a backend that takes 10 ms a token."""
    be = make_backend(length=30, delay=0.01)
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    yield server, be, c
    await c.close()


async def test_a_background_response_is_read_back_when_done(sdk, until):
    server, be, c = sdk
    r = await c.responses.create(model=MODEL, input=WORDS, background=True)
    assert (r.status, r.background, r.output) == ("queued", True, [])
    await until(lambda: r.id not in server.proxy.running)
    done = await c.responses.retrieve(r.id)
    assert (done.status, done.output_text, done.usage.output_tokens) == ("completed", WORDS, 30)
    assert (await c.responses.create(model=MODEL, input="more", previous_response_id=r.id)).output_text == "more"
    # cancelled while it generates: the engine lets go of it, and it is read back as cancelled
    r = await c.responses.create(model=MODEL, input=WORDS, background=True)
    await until(lambda: be.active)
    gone = await c.responses.cancel(r.id)
    assert gone.status == "cancelled" and (await c.responses.retrieve(r.id)).status == "cancelled"
    assert be.aborted and not be.active and server.proxy.in_flight == 0
    assert (await c.responses.cancel(r.id)).status == "cancelled"  # again: as it is
    plain = await c.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        await c.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.cancel("resp_nope")


async def test_a_background_response_the_engine_fails_is_read_back_failed(start, make_backend, until):
    be = make_backend(fail="generate")
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    r = await c.responses.create(model=MODEL, input="a b", background=True)
    await until(lambda: r.id not in server.proxy.running)
    got = await c.responses.retrieve(r.id)
    assert got.status == "failed" and got.error.code == "engine_error"
    await c.close()


async def test_shutdown_finishes_a_background_response(start, make_backend):
    be = make_backend(length=20, delay=0.01)
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    r = await c.responses.create(model=MODEL, input=" ".join(f"w{i}" for i in range(20)), background=True)
    await c.close()
    await server.stop()  # drains: the background response runs to its end
    assert server.proxy.running == {}
    assert b'"status":"completed"' in server.proxy.stored.get(r.id, server.proxy.tenant({"Authorization": "Bearer k"})).body


async def test_a_streamed_background_response_is_left_and_resumed(sdk, until):
    server, be, c = sdk
    stream = await c.responses.create(model=MODEL, input=WORDS, background=True, stream=True)
    seen = []
    async for e in stream:
        seen.append(e)
        if e.type == "response.output_text.delta" and len(seen) > 6:
            break
    await stream.close()  # the client leaves; the response goes on
    assert [e.type for e in seen[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert seen[0].response.status == "queued" and seen[0].response.background
    rid, last = seen[0].response.id, seen[-1].sequence_number
    assert rid in server.proxy.running  # still generating
    rest = [e async for e in await c.responses.retrieve(rid, stream=True, starting_after=last)]
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == WORDS
    deltas = [e.delta for e in seen + rest if e.type == "response.output_text.delta"]
    assert "".join(deltas) == WORDS and not be.aborted
    # Once done, the whole stream again, through the SDK's accumulator, and nothing after the end
    async with c.responses.stream(response_id=rid) as again:
        final = await again.get_final_response()
    assert final.output_text == WORDS and final.status == "completed"
    end = rest[-1].sequence_number
    assert [e async for e in await c.responses.retrieve(rid, stream=True, starting_after=end)] == []
    got = server.proxy.stored.get(rid, server.proxy.tenant({"Authorization": "Bearer k"}))
    assert got.feed.done and got.size > got.feed.size > len(got.body)  # the store counts the events


async def test_two_followers_and_a_cancel(sdk, until):
    server, be, c = sdk
    stream = await c.responses.create(model=MODEL, input=WORDS, background=True, stream=True)
    first = await stream.__anext__()
    other = await c.responses.retrieve(first.response.id, stream=True)

    async def read(s) -> list:
        return [e async for e in s]

    tasks = [asyncio.create_task(read(s)) for s in (stream, other)]
    await until(lambda: be.active)
    gone = await c.responses.cancel(first.response.id)
    a, b = await asyncio.gather(*tasks)
    assert gone.status == "cancelled" and be.aborted
    assert [first, *a][-1].type == b[-1].type == "error" and b[-1].code == "response_cancelled"
    assert [e.sequence_number for e in b] == list(range(len(b))) == [e.sequence_number for e in [first, *a]]


async def test_what_cannot_be_streamed_is_a_400(sdk):
    server, be, c = sdk
    plain = await c.responses.create(model=MODEL, input="a b")
    quiet = await c.responses.create(model=MODEL, input="a b", background=True)
    for r in (plain, quiet):
        with pytest.raises(openai.BadRequestError, match="created with stream: true") as e:
            await c.responses.retrieve(r.id, stream=True)
        assert e.value.body["param"] == "stream"
    loud = await c.responses.create(model=MODEL, input="a b", background=True, stream=True)
    rid = (await loud.__anext__()).response.id
    await loud.close()
    for query, param in ({"stream": "maybe"}, "stream"), ({"stream": "true", "starting_after": "x"}, "starting_after"), \
            ({"stream": "true", "starting_after": "-2"}, "starting_after"):
        with pytest.raises(openai.BadRequestError) as e:
            await c.get(f"/responses/{rid}", cast_to=object, options={"params": query})
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve("resp_nope", stream=True)


async def test_a_feed_wakes_every_follower():
    feed = Feed()

    async def follow(after: int) -> list[bytes]:
        return [f async for f in feed.follow(after)]

    early, late = asyncio.create_task(follow(-1)), asyncio.create_task(follow(1))
    for i in range(4):
        feed.add(b"%d" % i)
        await asyncio.sleep(0)
    feed.close()
    assert await early == [b"0", b"1", b"2", b"3"] and await late == [b"2", b"3"]
    assert feed.size == 4 and await follow(9) == []
