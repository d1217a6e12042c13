"""Several proxies, one simulation: with `serve --mqtt URL --mqtt-peers`, the proxies on
a broker tell each other, over the control plane, which agents came to them in a round
and what they answered. An agent's requests may then go to any of them (a load
balancer in front of several):

- a round's barrier does not wait for an expected agent that came to another proxy, and
  the next round expects it too;
- an agent's round count follows its requests wherever they went;
- a prompt that quotes an answer another proxy served finds it as a shared segment, as
  it finds the answers its own proxy served (so that answer's text crosses the broker:
  the flag is off by default).

- in front of the same fleet of engines, a session stays on one engine: each proxy
  tells the others where it pinned a session, and the pin decided first wins;
- a stored response of the Responses API is stored by every proxy (and deleted from
  every one), so a conversation goes on by `previous_response_id` at any of them (a
  streamed background response's events stay with the proxy that made it).

Each proxy still sends its own part of a round to the backend as its own group, and
publishes its own round stats. Topics, beside open / seal / done (proxy/mqtt.py):
tokendance/{session}/round/{round}/arrived (`Arrived`), .../said (`Said`),
tokendance/{session}/pinned (`Pinned`) and tokendance/responses/{id}/stored (`Shared`)
or .../deleted (`Dropped`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from tokendance.backend.fleet import Fleet

from .mqtt import PINNED, PREFIX, RESPONSES, STORE_EVENTS, topic
from .session import Round, check_name
from .stored import Stored

if TYPE_CHECKING:
    from .core import Proxy


class Arrived(Struct):
    agent: str
    origin: str  # the proxy it came to
    owner: str = ""  # whose session (Proxy.owner)


class Said(Struct):
    text: str
    origin: str
    tenant: str = ""  # whose requests may find it (a hash of the API key)
    agent: str | None = None
    owner: str = ""


class Pinned(Struct):
    engine: str  # its URL
    at: float  # when it was decided (the wall clock)
    origin: str


class Shared(Struct):
    """A stored response (proxy/stored.py), its encoded parts as they are."""

    origin: str
    body: msgspec.Raw
    conversation: msgspec.Raw
    inputs: msgspec.Raw
    tenant: str
    tags: tuple[str | None, str | None, str | None]


class Dropped(Struct):
    origin: str
    tenant: str


_arrived, _said, _pinned = msgspec.json.Decoder(Arrived), msgspec.json.Decoder(Said), msgspec.json.Decoder(Pinned)
_shared, _dropped = msgspec.json.Decoder(Shared), msgspec.json.Decoder(Dropped)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{24}")


class Peers:
    def __init__(self, proxy: Proxy, send: Callable[[str, bytes], None]):
        self.proxy, self.send = proxy, send  # send(topic, payload)
        self.origin = secrets.token_hex(8)
        fleet = proxy.backend
        if isinstance(fleet, Fleet):
            fleet.origin = self.origin
            fleet.on_pin = self.pinned
        proxy.stored.shared = self.stored

    def arrived(self, rnd: Round, agent: str) -> None:
        self.send(topic(rnd.session, rnd.number, "arrived"), msgspec.json.encode(Arrived(agent, self.origin, rnd.owner)))

    def said(self, rnd: Round, agent: str | None, tenant: str, text: str) -> None:
        self.send(topic(rnd.session, rnd.number, "said"),
                  msgspec.json.encode(Said(text, self.origin, tenant, agent, rnd.owner)))

    def pinned(self, session: str, engine: str, decided: tuple[float, str]) -> None:
        self.send(f"{PREFIX}/{session}/{PINNED}", msgspec.json.encode(Pinned(engine, *decided)))

    def stored(self, id: str, s: Stored | None, tenant: str) -> None:
        if s is None:
            self.send(f"{PREFIX}/{RESPONSES}/{id}/deleted", msgspec.json.encode(Dropped(self.origin, tenant)))
        else:
            self.send(f"{PREFIX}/{RESPONSES}/{id}/stored", msgspec.json.encode(Shared(
                self.origin, msgspec.Raw(s.body), msgspec.Raw(s.conversation), msgspec.Raw(s.inputs),
                s.tenant, s.tags)))

    def handle(self, session: str, number: int, event: str, payload: bytes) -> None:
        """A peer's message (this proxy's own come back from the broker: skipped). For a
        stored response's, `session` is the response's id."""
        px = self.proxy
        if event in STORE_EVENTS:
            if not RESPONSE_ID.fullmatch(session):
                raise ValueError("not a response id")
            m = (_shared if event == "stored" else _dropped).decode(payload)
            if m.origin == self.origin:
                return
            if isinstance(m, Dropped):
                px.stored.delete(session, m.tenant, share=False)
            else:
                px.stored.put(session, Stored(bytes(m.body), bytes(m.conversation), bytes(m.inputs), m.tenant,
                                              m.tags), share=False)
        elif event == "arrived":
            a = _arrived.decode(payload)
            if a.origin == self.origin:
                return
            check_name(a.agent, "agent")
            rnd = px.round(session, number, a.owner)
            counts = px.sessions.all[a.owner, session].counts  # its next request, here, is its next round
            counts[a.agent] = max(counts.get(a.agent, 0), number)
            px.barrier.elsewhere(rnd.gate, a.agent)
        elif event == "said":
            s = _said.decode(payload)
            if s.origin == self.origin:
                return
            if s.agent is not None:
                check_name(s.agent, "agent")
            px.sessions.remember(px.round(session, number, s.owner), s.agent, s.text, s.tenant)
        elif event == PINNED:
            p = _pinned.decode(payload)
            if p.origin != self.origin and isinstance(px.backend, Fleet):
                check_name(session, "session")
                px.backend.adopt(session, p.engine, (p.at, p.origin))
