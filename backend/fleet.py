"""Several engines behind one proxy (`tokendance serve --engine URL --engine URL ...`, or
several vLLM servers: `--vllm URL --vllm URL ...`).

A session is pinned to one engine: its rounds' Masters, its agents' Mirrors and parked
KV live there, so every request of it goes there. A pin is a session's name within a
tenant (the API key: KV is never shared across keys), so two tenants' sessions of one
name spread out like any two sessions. A new session goes to the engine whose
active sessions weigh least: a session is active for ACTIVE seconds after its last
request and weighs the requests of its latest round (a round of 20 agents weighs more
than one of 2; a simulation that ended weighs nothing once it is idle). It counts from
its first request's arrival, before the barrier, so simulations that start together
spread out. Requests outside any session take the engines in turn, but those of one
route (`Request.route`: a beam search's steps) stay on the engine the first took.

An engine that reports a problem (its /health, or a group it lost) takes no new work;
its sessions move to another engine at their next request, where what they had cached
is computed again. Requests it could not take at all move at once (backend/failover.py).
The proxy is healthy while one engine is.

Several proxies in front of the same engines (proxy/peers.py) tell each other where
they pinned a session (`on_pin`), and `adopt` another's pin: when two pinned one
session apart, the pin decided first (by the wall clock, then by who decided) wins
everywhere.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog

from tokendance.backend.api import BackendError, Prepared, Request, Template
from tokendance.backend.failover import Failover, Part, Place
from tokendance.backend.protocol import Backend, Gauge, Stream

log = structlog.get_logger(__name__)

Key = tuple[str, str]  # a pinned session: its tenant, its name
ACTIVE = 120.0  # seconds a session counts after its last request
MAX_PINS = 100_000  # sessions remembered (least recently used forgotten first)


@dataclass(slots=True)
class Routed:
    """A prepared request's engine, and what that engine prepared."""

    engine: int
    inner: Prepared


@dataclass(slots=True)
class Pin:
    """A session's engine, and what it weighs there."""

    engine: int
    used: float  # when it was last routed
    round: int | None = None  # its latest round
    size: int = 0  # requests of that round so far
    decided: tuple[float, str] = (0.0, "")  # when (wall clock) and by whom (a proxy) it was put there

    def count(self, request: Request) -> None:
        if request.round != self.round:
            self.round, self.size = request.round, 0
        self.size += 1


class Fleet:
    """A Backend over several engines that serve the same model with the same tokenizer."""

    def __init__(self, engines: list[Backend], names: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.engines = engines
        self.names = names or [str(i) for i in range(len(engines))]
        first = engines[0]
        for name, e in zip(self.names[1:], engines[1:]):
            _check_same(first, e, self.names[0], name)
        self.info = first.info
        self.tokenizer = first.tokenizer
        self.pins: OrderedDict[Key, Pin] = OrderedDict()  # least recent first
        self._turn = itertools.count()  # requests outside sessions
        self.routes: OrderedDict[Key, int] = OrderedDict()  # (tenant, route): engine; least recent first
        self._clock = clock
        self._down: list[str | None] = [None] * len(engines)  # last problem seen, for the log
        self.resent = 0  # requests an engine could not take or was lost running, sent to another
        self.origin = ""  # this proxy, among several (proxy/peers.py)
        self.on_pin: Callable[[Key, str, tuple[float, str]], None] | None = None  # engine, decided

    @classmethod
    async def connect(cls, urls: list[str], connect: Callable[[str], Awaitable[Backend]]) -> "Fleet":
        """`connect` to every engine at `urls` (RemoteBackend.connect, VLLMBackend.connect);
        BackendError naming the first that cannot answer."""
        engines: list[Backend] = []
        try:
            for url in urls:
                engines.append(await connect(url))
            return cls(engines, [u.rstrip("/") for u in urls])
        except BaseException:
            for e in engines:
                await e.close()
            raise

    # -- routing -------------------------------------------------------------------------

    def route(self, request: Request) -> int:
        """The engine `request` goes to (and, for a session, stays on)."""
        up = [i for i in range(len(self.engines)) if self._serves(i)] or [0]  # none: 0's error
        if request.session is None:
            if request.route is None:
                return up[next(self._turn) % len(up)]
            r = (request.tenant, request.route)
            j = self.routes.get(r)
            if j is None or j not in up:
                j = self.routes[r] = up[next(self._turn) % len(up)]
                while len(self.routes) > MAX_PINS:
                    self.routes.popitem(last=False)
            self.routes.move_to_end(r)
            return j
        s = (request.tenant, request.session)
        t = self._clock()
        pin = self.pins.get(s)
        if pin is not None:
            pin.used = t
            self.pins.move_to_end(s)  # the pins stay in the order of `used`
            if pin.engine in up:
                return pin.engine
        weight, count = self.loads()
        j = min(up, key=lambda i: (weight[i], count[i]))
        decided = (time.time(), self.origin)
        if pin is None:
            self._pin(s, j, t, decided)
        else:
            log.warning("session moved", session=s[1], engine=self.names[j], was=self.names[pin.engine],
                        why=self._down[pin.engine])
            pin.engine, pin.decided = j, decided
        if self.on_pin is not None:
            self.on_pin(s, self.names[j], decided)
        return j

    def adopt(self, session: Key, engine: str, decided: tuple[float, str]) -> None:
        """Another proxy pinned `session` on `engine`: so does this one, unless its own pin
        was decided first (or the engine is not in this fleet, or cannot serve)."""
        if engine not in self.names:
            return
        j = self.names.index(engine)
        pin = self.pins.get(session)
        if pin is None:
            self._pin(session, j, self._clock(), decided)
        elif pin.engine != j and decided < pin.decided and self._serves(j):
            log.info("session moved", session=session[1], engine=engine, was=self.names[pin.engine],
                     why="another proxy pinned it first")
            pin.engine, pin.decided = j, decided

    def _pin(self, session: Key, engine: int, t: float, decided: tuple[float, str]) -> None:
        self.pins[session] = Pin(engine, t, decided=decided)
        while len(self.pins) > MAX_PINS:
            self.pins.popitem(last=False)

    def loads(self) -> tuple[list[int], list[int]]:
        """What each engine's active sessions weigh, and how many there are."""
        t = self._clock()
        weight, count = [0] * len(self.engines), [0] * len(self.engines)
        for pin in reversed(self.pins.values()):  # most recent first, up to the first idle one
            if t - pin.used > ACTIVE:
                break
            weight[pin.engine] += pin.size
            count[pin.engine] += 1
        return weight, count

    def _serves(self, i: int) -> bool:
        problem = self.engines[i].problem()
        if problem != self._down[i]:
            if problem is None:
                log.info("engine back", engine=self.names[i])
            else:
                log.warning("engine down", engine=self.names[i], problem=problem)
            self._down[i] = problem
        return problem is None

    # -- the Backend protocol ------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        return self.engines[0].render_chat(messages, tools, template)

    def prepare(self, request: Request) -> Prepared:
        """Prepared by the engine it is routed to; it weighs from here, so a round's
        requests count before they are generated."""
        i = self.route(request)
        p = self.engines[i].prepare(request)
        if request.session is not None:
            self.pins[request.tenant, request.session].count(request)
        return Prepared(request, p.prompt_tokens, Routed(i, p), p.ids)

    def generate(self, group: list[Prepared]) -> list[Stream]:
        """Each request to its session's engine (routed again: its engine may have gone
        down at the barrier); a group's requests outside any session stay together, on
        the engine that prepared the first of them while it serves. A request that moved
        is prepared again where it goes. What an engine cannot take is sent again
        (backend/failover.py)."""
        return [Failover(self.again, part, k) for part, k in self._start(group, self._split(group), 0)]

    def again(self, part: Part) -> None:
        """Send `part`, which its engine could not take, to where its requests are routed
        now (once, for all its streams); a request whose engine is not another that
        serves stays, and its client gets the error."""
        if part.moved is not None:
            return
        part.moved = [None] * len(part.group)
        if part.hops + 1 >= len(self.engines):
            return
        todo = [k for k in range(len(part.group)) if not part.kept[k]]
        group = [part.group[k] for k in todo]
        try:
            split = {i: ms for i, ms in self._split(group).items() if i != part.engine and self._serves(i)}
            placed = self._start(group, split, part.hops + 1)
        except Exception as e:  # (a prepare or generate that fails) they stay: each gets its own error
            log.warning("group not sent again", engine=self.names[part.engine], error=repr(e))
            return
        for k, place in zip(todo, placed):
            if place is not None:
                part.streams[k].abort()
                part.moved[k] = place
                self.resent += 1
        if split:
            log.warning("group sent again", was=self.names[part.engine], requests=sum(p is not None for p in placed),
                        engines=sorted(self.names[i] for i in split))

    def _split(self, group: list[Prepared]) -> dict[int, list[tuple[int, Prepared]]]:
        """Each engine's requests of `group`: their indexes, and each as that engine prepared it."""
        parts: dict[int, list[tuple[int, Prepared]]] = {}
        loose: int | None = None
        for n, p in enumerate(group):
            r: Routed = p.state
            if p.request.session is not None:
                i = self.route(p.request)
            elif loose is None:
                i = loose = r.engine if self._serves(r.engine) else self.route(p.request)
            else:
                i = loose
            parts.setdefault(i, []).append((n, r.inner if i == r.engine else self.engines[i].prepare(p.request)))
        return parts

    def _start(self, group: list[Prepared], split: dict[int, list[tuple[int, Prepared]]],
               hops: int) -> list[Place | None]:
        """Start each engine's part of `split`; where each request of `group` went (None:
        nowhere). The parts start together or not at all."""
        placed: list[Place | None] = [None] * len(group)
        started: list[Part] = []
        try:
            for i, members in split.items():
                streams = self.engines[i].generate([q for _, q in members])
                part = Part(i, [group[n] for n, _ in members], streams, hops)
                started.append(part)
                if len(streams) != len(members):
                    raise BackendError(f"engine {self.names[i]} gave {len(streams)} streams for {len(members)} requests")
                for k, (n, _) in enumerate(members):
                    placed[n] = (part, k)
        except BaseException:  # what other engines started stops
            for part in started:
                for st in part.streams:
                    st.abort()
            raise
        return placed

    def gauges(self) -> list[Gauge]:
        """Every engine's gauges, labelled by engine, and the fleet's own."""
        out = [Gauge("fleet_engines_up", "engines serving now", sum(map(self._serves, range(len(self.engines))))),
               Gauge("fleet_resent_total", "requests an engine could not take or lost, sent to another", self.resent,
                     "counter")]
        weight, count = self.loads()
        for i, (name, e) in enumerate(zip(self.names, self.engines)):
            lab = {"engine": name}
            out.append(Gauge("fleet_sessions", f"sessions on the engine active in the last {ACTIVE:g} s",
                             count[i], labels=lab))
            out.append(Gauge("fleet_load", "requests of those sessions' latest rounds", weight[i], labels=lab))
            out += [replace(g, labels={**g.labels, **lab}) for g in e.gauges()]
        return out

    def problem(self) -> str | None:
        """None while one engine serves; otherwise every engine's problem."""
        if any(map(self._serves, range(len(self.engines)))):
            return None
        return "no engine can serve: " + "; ".join(f"{n}: {p}" for n, p in zip(self.names, self._down))

    async def close(self) -> None:
        for e in self.engines:
            await e.close()


def _check_same(a: Backend, b: Backend, name_a: str, name_b: str) -> None:
    """Engines of one fleet must be interchangeable for the proxy: same model, limits and
    tokenizer (the proxy tokenizes once, with the first one's)."""
    why = None
    if a.info != b.info:
        why = f"{a.info} against {b.info}"
    elif (a.tokenizer is None) != (b.tokenizer is None) or a.tokenizer is not None and (
            a.tokenizer.get_vocab() != b.tokenizer.get_vocab()
            or getattr(a.tokenizer, "chat_template", None) != getattr(b.tokenizer, "chat_template", None)):
        why = "their tokenizers differ"
    if why is not None:
        raise BackendError(f"engines {name_a} and {name_b} do not serve the same model: {why}")
