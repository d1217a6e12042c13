"""A fleet's requests that their engine could not take, or was lost while it ran them
(backend/fleet.py).

An engine that cannot be reached, or answers that it cannot serve, ran nothing of the
requests sent to it; one lost partway took what it generated with it (backend/reach.py).
The fleet sends them again, before their clients see an error, to the engines they are
routed to now: the one that failed is down by then, so its sessions move. A barrier
group's share of one engine (a Part) moves together, so it is still generated as one
group. Only requests that have shown their clients nothing move: a request read whole
(`Request.whole`) shows its deltas only once its engine has sent the last, so it moves
whenever its engine fails; a streamed one that has streamed, or whose client went away,
stays and ends as it does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokendance.backend.api import Delta, Lost, Prepared, Unavailable
from tokendance.backend.protocol import Stream

Place = tuple["Part", int]  # a part, and a request's index in it


@dataclass(slots=True)
class Part:
    """The requests of one group that went to one engine, and their streams there."""

    engine: int
    group: list[Prepared]  # as the fleet prepared them
    streams: list[Stream]
    hops: int = 0  # engines these requests were sent to before this one
    kept: list[bool] = field(init=False)  # shown to its client, or abandoned: never moved
    moved: list[Place | None] | None = None  # once sent again: where each request went

    def __post_init__(self) -> None:
        self.kept = [False] * len(self.group)


class Failover:
    """One request's stream from a fleet: its engine's, or, when that engine could not
    take it or was lost, the stream of the engine it was sent to next (`again(part)`
    sends a part once, for all its streams)."""

    def __init__(self, again: Callable[[Part], None], part: Part, k: int):
        self.again, self.part, self.k = again, part, k

    async def __aiter__(self) -> AsyncIterator[Delta]:
        over = False  # the stream ended here, not because its consumer left
        try:
            while True:
                part, k = self.part, self.k
                held: list[Delta] | None = [] if part.group[k].request.whole else None
                try:
                    async for d in part.streams[k]:
                        if _moved(part, k) is not None:
                            break  # sent again elsewhere: what this engine still sends is dropped
                        if held is not None:
                            d.at = time.perf_counter()
                            held.append(d)
                            continue
                        part.kept[k] = True
                        yield d
                except (Unavailable, Lost):
                    if part.kept[k]:
                        over = True
                        raise
                    self.again(part)
                    if _moved(part, k) is None:
                        over = True
                        raise
                except Exception:  # the request's error: its stream is over
                    over = True
                    raise
                nxt = _moved(part, k)
                if nxt is None:  # it finished, or was aborted
                    over = True
                    if held and not part.kept[k]:  # read whole: shown once its engine sent the last
                        part.kept[k] = True
                        for d in held:
                            yield d
                    return
                self.part, self.k = nxt
        finally:
            if not over:
                self.abort()

    def abort(self) -> None:
        place: Place | None = (self.part, self.k)
        while place is not None:  # the stream it reads, and any it was moved to since
            part, k = place
            part.kept[k] = True
            part.streams[k].abort()
            place = _moved(part, k)


def _moved(part: Part, k: int) -> Place | None:
    return None if part.moved is None else part.moved[k]
