"""Several engines behind one proxy (`tokendance serve --engine URL --engine URL ...`).

A session is pinned to one engine: its rounds' Masters, its agents' Mirrors and parked
KV live there, so every request of it goes there. A new session goes to the engine with
the least recent work: requests routed to it, decaying with a half-life of HALF_LIFE
seconds (so a session of 20 agents weighs more than one of 2, and work from an hour ago
nothing). A request outside any session goes to the least loaded engine the same way.

An engine that reports a problem (its /health, or a group it lost) takes no new work;
its sessions move to another engine at their next request, where what they had cached
is computed again. The proxy is healthy while one engine is.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog

from tokendance.backend.api import Backend, BackendError, Gauge, Prepared, Request, Stream

log = structlog.get_logger(__name__)

HALF_LIFE = 60.0  # seconds
MAX_PINS = 100_000  # sessions remembered (least recently used forgotten first)


@dataclass(slots=True)
class Load:
    """Requests routed to an engine, decayed exponentially over time."""

    value: float = 0.0
    at: float = 0.0

    def now(self, t: float) -> float:
        return self.value * math.exp2(-(t - self.at) / HALF_LIFE) if self.value else 0.0

    def add(self, n: int, t: float) -> None:
        self.value, self.at = self.now(t) + n, t


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
        self.pins: OrderedDict[str, int] = OrderedDict()  # session -> engine index
        self.loads = [Load() for _ in engines]
        self._clock = clock
        self._down: list[str | None] = [None] * len(engines)  # last problem seen, for the log

    @classmethod
    async def connect(cls, urls: list[str], mode: str = "collective", timeout: float = 10.0) -> "Fleet":
        """Connect to every engine at `urls`; BackendError naming the first that cannot answer."""
        from tokendance.backend.remote import RemoteBackend

        engines: list[Backend] = []
        try:
            for url in urls:
                engines.append(await RemoteBackend.connect(url, mode, timeout))
            return cls(engines, [e.url for e in engines])  # type: ignore[attr-defined]
        except BaseException:
            for e in engines:
                await e.close()
            raise

    # -- routing -------------------------------------------------------------------------

    def route(self, request: Request) -> int:
        """The engine `request` goes to (and, for a session, stays on)."""
        s = request.session
        i = self.pins.get(s) if s is not None else None
        if i is not None and self._serves(i):
            self.pins.move_to_end(s)
            return i
        j = self._least_loaded(avoid=i)
        if s is not None:
            if i is not None and j != i:
                log.warning("session moved", session=s, engine=self.names[j], was=self.names[i],
                            why=self._down[i])
            self.pins[s] = j
            self.pins.move_to_end(s)
            while len(self.pins) > MAX_PINS:
                self.pins.popitem(last=False)
        return j

    def _least_loaded(self, avoid: int | None) -> int:
        t = self._clock()
        up = [i for i in range(len(self.engines)) if i != avoid and self._serves(i)]
        if not up:  # nothing serves: the first gives the error its requests get
            return avoid if avoid is not None else 0
        return min(up, key=lambda i: (self.loads[i].now(t), i))

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

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self.engines[0].render_chat(messages, tools)

    def prepare(self, request: Request) -> Prepared:
        """Prepared by the engine it is routed to (every engine would prepare it alike); its
        load counts from here, so a round's requests weigh before they are generated."""
        i = self.route(request)
        p = self.engines[i].prepare(request)
        self.loads[i].add(1, self._clock())
        return p

    def generate(self, group: list[Prepared]) -> list[Stream]:
        """Each request to its session's engine (routed again: its engine may have gone
        down at the barrier); a group's requests outside any session stay together."""
        parts: dict[int, list[int]] = {}
        loose: int | None = None
        for k, p in enumerate(group):
            if p.request.session is None:
                loose = self.route(p.request) if loose is None else loose
                i = loose
            else:
                i = self.route(p.request)
            parts.setdefault(i, []).append(k)
        streams: list[Stream | None] = [None] * len(group)
        for i, ks in parts.items():
            got = self.engines[i].generate([group[k] for k in ks])
            if len(got) != len(ks):
                raise BackendError(f"engine {self.names[i]} gave {len(got)} streams for {len(ks)} requests")
            for k, st in zip(ks, got):
                streams[k] = st
        return streams  # type: ignore[return-value]

    def gauges(self) -> list[Gauge]:
        """Every engine's gauges, labelled by engine, and the fleet's own."""
        t = self._clock()
        out = [Gauge("fleet_engines_up", "engines serving now", sum(map(self._serves, range(len(self.engines)))))]
        pinned = [0] * len(self.engines)
        for i in self.pins.values():
            pinned[i] += 1
        for i, (name, e) in enumerate(zip(self.names, self.engines)):
            lab = {"engine": name}
            out.append(Gauge("fleet_sessions", "sessions pinned to the engine", pinned[i], labels=lab))
            out.append(Gauge("fleet_load", f"requests routed to the engine, halved every {HALF_LIFE:g} s",
                             round(self.loads[i].now(t), 3), labels=lab))
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
