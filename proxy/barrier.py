"""The round barrier: hold the requests of one (session, round) and release them as one group.

A group is released when every expected agent has arrived, when the round is sealed,
when `timeout` has passed since the group's first arrival, or when it reaches
`max_size`. Arrivals after a release form the next group under the same rules, so a
straggler of a timed-out round is released as soon as the last missing agent arrives.
The barrier knows nothing about HTTP or engines: `dispatch` gets each released group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokendance.backend.api import Prepared
from tokendance.backend.protocol import Stream


@dataclass(slots=True, eq=False)
class Entry:
    agent: str | None
    prepared: list[Prepared]
    future: asyncio.Future[list[Stream]]
    arrived: float = field(default_factory=time.perf_counter)
    released: float = 0.0  # when the release was triggered
    group: int = 0  # size of the group it went in, in entries
    reason: str = ""
    tag: Any = None  # the owner's data (the proxy's Call)


@dataclass(slots=True, eq=False)
class Gate:
    """Barrier state of one round."""

    expected: frozenset[str] | None = None  # None: nobody announced
    announced: bool = False  # expected came from open, not from the previous round
    missing: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)  # agents already released
    away: set[str] = field(default_factory=set)  # agents that came to another proxy (proxy/peers.py)
    sealed: bool = False
    timeout: float | None = None  # overrides the barrier's default
    pending: list[Entry] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    groups: int = 0

    @property
    def agents(self) -> set[str]:
        return self.done | {e.agent for e in self.pending if e.agent is not None}


Dispatch = Callable[[Gate, list[Entry], str], Any]


class Barrier:
    def __init__(self, dispatch: Dispatch, timeout: float = 0.25, max_size: int = 256):
        self.dispatch = dispatch
        self.timeout = timeout
        self.max_size = max_size
        self.waiting = 0

    async def wait(self, gate: Gate, entry: Entry) -> list[Stream]:
        self.join(gate, entry)
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.leave(gate, entry)
            raise

    def join(self, gate: Gate, entry: Entry) -> None:
        gate.pending.append(entry)
        self.waiting += 1
        if entry.agent is not None:
            gate.missing.discard(entry.agent)
        if self._ready(gate):
            self.release(gate, self._reason(gate))
        elif gate.timer is None:
            timeout = self.timeout if gate.timeout is None else gate.timeout
            loop = asyncio.get_running_loop()
            gate.timer = loop.call_later(timeout, self.release, gate, "timeout")

    def leave(self, gate: Gate, entry: Entry) -> None:
        """A waiter went away (client disconnect) before its group was released."""
        if entry not in gate.pending:
            return
        gate.pending.remove(entry)
        self.waiting -= 1
        a = entry.agent
        if (a is not None and gate.expected and a in gate.expected and a not in gate.done
                and all(e.agent != a for e in gate.pending)):
            gate.missing.add(a)
        if not gate.pending and gate.timer is not None:
            gate.timer.cancel()
            gate.timer = None

    def unanswered(self, gate: Gate, agent: str | None) -> None:
        """`agent`'s request failed after its group left (its engine could not take it,
        or was lost): the agent is awaited again, so that the group's retries, which
        clients send after the same Retry-After or nearly the same backoff, go together."""
        if agent is not None and gate.expected is not None and agent in gate.expected and agent in gate.done:
            gate.done.discard(agent)
            gate.missing.add(agent)

    def expect(self, gate: Gate, agents: Iterable[str], announced: bool = True) -> None:
        gate.expected = frozenset(agents)
        gate.announced = announced
        gate.missing = set(gate.expected) - gate.agents - gate.away
        if gate.pending and self._ready(gate):
            self.release(gate, "all")

    def elsewhere(self, gate: Gate, agent: str) -> None:
        """`agent` came to another proxy of this round: it is not awaited here."""
        gate.away.add(agent)
        gate.missing.discard(agent)
        if gate.pending and self._ready(gate):
            self.release(gate, "all")

    def seal(self, gate: Gate) -> None:
        gate.sealed = True
        if gate.pending:
            self.release(gate, "sealed")

    def release(self, gate: Gate, reason: str) -> None:
        if gate.timer is not None:
            gate.timer.cancel()
            gate.timer = None
        entries, gate.pending = gate.pending, []
        if not entries:
            return
        self.waiting -= len(entries)
        now = time.perf_counter()
        for e in entries:
            e.released, e.group, e.reason = now, len(entries), reason
            if e.agent is not None:
                gate.done.add(e.agent)
        gate.groups += 1
        self.dispatch(gate, entries, reason)

    def _ready(self, gate: Gate) -> bool:
        timeout = self.timeout if gate.timeout is None else gate.timeout
        return (gate.sealed or len(gate.pending) >= self.max_size or timeout <= 0
                or (gate.expected is not None and not gate.missing))

    def _reason(self, gate: Gate) -> str:
        if gate.sealed:
            return "sealed"
        if gate.expected is not None and not gate.missing:
            return "all"
        return "full" if len(gate.pending) >= self.max_size else "timeout"
