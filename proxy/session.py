"""Sessions and rounds: who is in which round, what each round produced, its stats.

Round inference, when a request names no round: a named agent's k-th request in a
session is its round k (an explicit round r moves its count to r). An anonymous
request joins the session's latest round while that round's group is still forming,
and otherwise starts the next one. A request that resumes a turn (its last message is a
tool's result) stays in its agent's round (an anonymous one in the latest). A round
that nobody announced expects the named agents of the previous round (with peers, those
that came to the other proxies too: proxy/peers.py).

Sessions are named within an owner: with `--api-key`, each key's requests and round
control see only that key's sessions (two keys that name one session hold two); without,
keys are not checked, and every request shares the one namespace.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from tokendance.backend.api import MODES

from .barrier import Gate
from .errors import invalid
from .schemas import TokenDance
from .known import Known, Outputs, cost
from .stats import RoundStats

log = structlog.get_logger("tokendance.proxy")
HEADER = "X-TokenDance-"
# Surrogates: what aiohttp makes of header bytes that are not UTF-8 (no MQTT topic takes them).
# Brokers (mosquitto) also drop a client that publishes DEL, a C1 control or a Unicode
# noncharacter in a topic, and aiohttp refuses DEL in a response header.
_BAD = set("/+#") | {chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), *range(0xD800, 0xE000),
                                       *range(0xFDD0, 0xFDF0), *(p | 0xFFFE for p in range(0, 0x110000, 0x10000)),
                                       *(p | 0xFFFF for p in range(0, 0x110000, 0x10000)))}
MAX_ROUND = 2**63 - 1  # a signed 64-bit int
_TRUE, _FALSE = {"1", "true", "on", "yes"}, {"0", "false", "off", "no"}


@dataclass(slots=True)
class Meta:
    session: str | None = None
    agent: str | None = None
    agents: list[str] | None = None  # a batch of chats': its conversations' agents
    round: int | None = None
    mode: str | None = None
    separators: bool = False
    resumes: bool = False  # the last message is a tool's result: the agent's turn goes on
    owner: str = ""  # whose sessions it names (Proxy.owner)


def read_meta(headers: Mapping[str, str], body: TokenDance | None) -> Meta:
    """Metadata from the body's `tokendance` object, else from X-TokenDance-* headers."""
    b = body or TokenDance()

    def pick(name: str) -> str | None:
        v = getattr(b, name)
        return v if v is not None else headers.get(HEADER + name.capitalize())

    m = Meta(session=pick("session"), agent=pick("agent"), mode=pick("mode"))
    for name in ("session", "agent"):
        if getattr(m, name) is not None:
            check_name(getattr(m, name), f"tokendance.{name}")
    agents = b.agents if b.agents is not None else headers.get(HEADER + "Agents")
    if agents is not None:
        m.agents = [a.strip() for a in agents.split(",")] if isinstance(agents, str) else agents
        for a in m.agents:
            check_name(a, "tokendance.agents")
    if m.mode is not None and m.mode not in MODES:
        raise invalid(f"mode must be one of {', '.join(MODES)}", "tokendance.mode")
    r = b.round if b.round is not None else headers.get(HEADER + "Round")
    m.round = None if r is None else round_number(r, "tokendance.round")
    sep = b.separators if b.separators is not None else headers.get(HEADER + "Separators")
    if isinstance(sep, str):
        if sep.lower() not in _TRUE | _FALSE:
            raise invalid("X-TokenDance-Separators must be on or off", "tokendance.separators")
        sep = sep.lower() in _TRUE
    m.separators = bool(sep)
    return m


def round_number(raw: str | int, param: str) -> int:
    """A round from a header, a URL or a body: 0 .. MAX_ROUND (int() refuses over 4300 digits)."""
    if isinstance(raw, str):
        raw = raw.strip()
        raw = int(raw) if raw.isdecimal() and len(raw) <= len(str(MAX_ROUND)) else -1
    if not 0 <= raw <= MAX_ROUND:
        raise invalid(f"round must be a non-negative integer up to {MAX_ROUND}", param)
    return raw


def check_name(value: str, param: str) -> None:
    """Session and agent names: they become parts of MQTT topics."""
    if not 0 < len(value) <= 256 or _BAD.intersection(value):
        raise invalid(f"{param.split('.')[-1]} must be 1-256 characters of UTF-8 without '/', '+', '#', "
                      "control characters or Unicode noncharacters", param)


@dataclass(slots=True, eq=False)
class Round:
    session: str
    number: int
    owner: str = ""
    gate: Gate = field(default_factory=Gate)
    stats: RoundStats = field(default_factory=RoundStats)
    outputs: dict[str, Outputs] = field(default_factory=dict)  # by tenant; as generated and stripped
    active: int = 0  # admitted, not yet answered
    full: bool = False  # outputs reached Sessions.max_round_bytes

    def view(self) -> dict:
        g = self.gate
        return self.stats.view(self.session, self.number, g.agents, g.expected, g.sealed, self.active)


@dataclass(slots=True, eq=False)
class Session:
    name: str
    owner: str = ""
    rounds: dict[int, Round] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # agent -> its latest round
    latest: int = 0
    used: float = field(default_factory=time.monotonic)

    @property
    def active(self) -> int:
        return sum(r.active for r in self.rounds.values())


class Sessions:
    def __init__(self, memory: int = 2, keep: int = 64, ttl: float = 3600.0, max_sessions: int = 10_000,
                 min_chars: int = 16, max_round_bytes: int = 2**24, max_bytes: int = 2**28):
        self.memory = memory  # rounds back whose outputs are searched in a prompt
        self.reach = 4 * (memory + 1)  # rounds searched at most (each costs ~0.2 ms a 20 k-char prompt)
        self.keep = keep  # rounds kept per session (stats and outputs)
        self.ttl = ttl
        self.max_sessions = max_sessions
        self.min_chars = min_chars  # shorter outputs are not searched for
        self.max_round_bytes = max_round_bytes  # outputs remembered per round (estimated)
        self.max_bytes = max_bytes  # ... and in all (the rounds added to longest ago forget first)
        self.bytes = 0
        self._lru: OrderedDict[Round, None] = OrderedDict()  # rounds holding outputs
        self.all: dict[tuple[str, str], Session] = {}  # by (owner, name)
        self._swept = time.monotonic()

    def get(self, name: str, owner: str = "") -> Session:
        s = self.all.get((owner, name))
        if s is None:
            self._sweep()
            s = self.all[owner, name] = Session(name, owner)
        s.used = time.monotonic()
        return s

    def round(self, name: str, number: int, owner: str = "") -> Round:
        s = self.get(name, owner)
        r = s.rounds.get(number)
        if r is None:
            r = s.rounds[number] = Round(name, number, owner)
            prev = s.rounds.get(number - 1)
            if prev is not None and (prev.gate.agents or prev.gate.away):
                r.gate.expected = frozenset(prev.gate.agents | prev.gate.away)
                r.gate.missing = set(r.gate.expected)
            s.latest = max(s.latest, number)
            self._trim(s, r)
        return r

    def find(self, name: str, number: int, owner: str = "") -> Round | None:
        s = self.all.get((owner, name))
        return s.rounds.get(number) if s else None

    def infer(self, m: Meta) -> int:
        """The round of a request, without recording anything."""
        if m.round is not None:
            return m.round
        s = self.all.get((m.owner, m.session or ""))
        if s is None:
            return 1
        if m.agent is not None:
            count = s.counts.get(m.agent, 0)
            return count if m.resumes and count else count + 1
        r = s.rounds.get(s.latest)
        if m.resumes and r is not None:
            return s.latest
        if r is not None and (r.gate.pending or (r.active == 0 and r.stats.requests == 0)):
            return s.latest
        return s.latest + 1

    def commit(self, m: Meta, number: int) -> tuple[Round, int]:
        """Record the request in its round; returns the agent's count before it."""
        r = self.round(m.session or "", number, m.owner)
        before = 0
        if m.agent is not None:
            counts = self.all[r.owner, r.session].counts
            before = counts.get(m.agent, 0)
            counts[m.agent] = max(before, number)
        return r, before

    def uncommit(self, m: Meta, r: Round, before: int) -> None:
        """A request went unanswered (it left, or failed): its retry belongs to the same round."""
        s = self.all.get((r.owner, r.session))
        if s is not None and m.agent is not None and s.counts.get(m.agent) == r.number:
            s.counts[m.agent] = before

    def known(self, name: str, number: int, tenant: str = "", owner: str = "") -> Known:
        """Outputs to look for in a prompt of round `number`: the tenant's (another tenant's
        could never be reused, and finding them would say what they were) of the last
        rounds before it, and of those before each agent's latest round. Agents' counts
        drift apart in an uneven conversation (a group chat's manager speaks every turn),
        and the manager's prompt then holds outputs of rounds far below its own."""
        s = self.all.get((owner, name))
        if s is None:
            return Known()
        wanted = set(range(max(number - self.memory, 0), number + 1))
        for latest in sorted(set(s.counts.values()), reverse=True):
            for k in range(latest, max(latest - self.memory, 0) - 1, -1):
                if len(wanted) < self.reach:
                    wanted.add(k)
        rounds = (s.rounds.get(k) for k in sorted(wanted, reverse=True))
        return Known(r.outputs[tenant] for r in rounds if r is not None and tenant in r.outputs)

    def remember(self, r: Round, agent: str | None, text: str, tenant: str = "") -> None:
        """Keep the output as generated (echoed verbatim, its span's tokens are the generated
        ones) and stripped (what frameworks that strip echo)."""
        if len(text.strip()) < self.min_chars:
            return
        outputs = r.outputs.setdefault(tenant, Outputs())
        for t in dict.fromkeys((text, text.strip())):
            if t in outputs:
                continue
            if _size(r) + cost(t) > self.max_round_bytes:
                if not r.full:
                    r.full = True
                    log.warning("round output memory full: later outputs are not looked for",
                                session=r.session, round=r.number)
                return
            outputs.add(t, (r.session, agent or "", r.number))
            self.bytes += cost(t)
        self._lru[r] = None
        self._lru.move_to_end(r)
        while self.bytes > self.max_bytes and next(iter(self._lru)) is not r:
            self._forget(next(iter(self._lru)))

    def _forget(self, r: Round) -> None:
        """Let go of a round's outputs (the round dropped, or the memory needed)."""
        self.bytes -= _size(r)
        r.outputs.clear()
        self._lru.pop(r, None)

    def _trim(self, s: Session, new: Round) -> None:
        """Drop the oldest idle rounds past `keep`; never the one just made (it is about to be used)."""
        if len(s.rounds) > self.keep:
            for k in sorted(s.rounds)[: len(s.rounds) - self.keep]:
                r = s.rounds[k]
                if r is not new and r.active == 0 and not r.gate.pending:
                    self._forget(r)
                    del s.rounds[k]

    def _sweep(self) -> None:
        now = time.monotonic()
        if len(self.all) < self.max_sessions and now - self._swept < 60:
            return
        self._swept = now
        idle = sorted((s.used, k) for k, s in self.all.items() if s.active == 0)
        over = len(self.all) - self.max_sessions + 1
        for i, (used, k) in enumerate(idle):
            if i < over or now - used > self.ttl:
                for r in self.all.pop(k).rounds.values():
                    self._forget(r)


def _size(r: Round) -> int:
    return sum(o.size for o in r.outputs.values())
