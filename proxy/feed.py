"""The events of a streamed background response, kept to be followed and resumed.

A background response created with `stream: true` writes its stream events here as
encoded SSE frames, numbered by their `sequence_number`. The request that created it
follows the feed from the start; `GET /v1/responses/{id}?stream=true&starting_after=N`
follows it from event N + 1, while the response runs or after it ended. A follower that
goes away leaves the response running. The feed is kept with the stored response, and
the store's budget counts its bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class Feed:
    def __init__(self) -> None:
        self.frames: list[bytes] = []  # frame i holds the event of sequence number i
        self.done = False
        self.size = 0
        self._more = asyncio.Event()  # set when a frame is added or the feed closes

    def add(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.size += len(frame)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()  # the followers awaiting the old one all wake

    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The frames after sequence number `after`, as they come, until the feed closes."""
        i = after + 1
        while True:
            more = self._more
            while i < len(self.frames):
                yield self.frames[i]
                i += 1
            if self.done:
                return
            await more.wait()
