"""A streamed answer starts with its first delta: until then nothing is sent, so an error
before any (an engine that could not take the request, a 503 with Retry-After) is an
HTTP error answer that a client sends again, as it would a non-streamed one, rather
than an event in a stream already answered 200."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokendance.backend.api import Delta
from tokendance.backend.protocol import Stream

from .call import Call


class Primed:
    """A stream whose first delta was read already."""

    def __init__(self, stream: Stream, it: AsyncIterator[Delta], first: Delta | None):
        self.stream, self.it, self.first = stream, it, first

    async def __aiter__(self) -> AsyncIterator[Delta]:
        if self.first is None:
            return
        yield self.first
        async for d in self.it:  # ends after a finishing delta
            yield d

    def abort(self) -> None:
        self.stream.abort()


async def primed(call: Call, streams: list[Stream]) -> list[Stream]:
    """`streams` with their first deltas read (a group's come together); raises the
    error of one that failed before any."""
    out: list[Stream] = []
    for st in streams:
        it = aiter(st)
        t = time.perf_counter()
        first = await anext(it, None)
        call.gen += time.perf_counter() - t
        out.append(Primed(st, it, first))
    return out
