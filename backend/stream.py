"""A request's deltas on the event loop, as a Backend's `generate` returns them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from tokendance.backend.api import Delta


class Owner(Protocol):
    def abort(self, rid: str) -> None: ...


class QueueStream:
    """Deltas as the producer `put`s them; iterate until one has a finish_reason. A
    consumer that stops early aborts the request at its owner (which frees its KV)."""

    def __init__(self, rid: str, owner: Owner):
        self.rid = rid
        self.owner = owner
        self.queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()  # None: aborted
        self.done = False  # the consumer is done with it
        self.ended = False  # its last delta, or its error, is in the queue

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while not self.done:
                item = await self.queue.get()
                if item is None:  # aborted (by another task) while this one waited
                    return
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                self.done = item.finish_reason is not None
                yield item
        finally:
            if not self.done:  # the consumer went away: free the request's KV now
                self.abort()

    def abort(self) -> None:
        """Stop the request; a consumer waiting for its next delta stops iterating."""
        if not self.done:
            self.done = True
            if not self.ended:
                self.owner.abort(self.rid)
            self.queue.put_nowait(None)

    def put(self, item: Delta | BaseException) -> None:
        """On the event loop's thread: the next delta, or the request's error."""
        if not self.done and not self.ended:
            self.ended = isinstance(item, BaseException) or item.finish_reason is not None
            self.queue.put_nowait(item)
