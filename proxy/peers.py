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
- a stored response of the Responses API, and a conversation object, is kept by every
  proxy (and deleted from every one), so a conversation goes on at any of them (a
  streamed background response's events stay with the proxy that made it).

Each proxy still sends its own part of a round to the backend as its own group, and
publishes its own round stats. Topics, beside open / seal / done (proxy/mqtt.py):
tokendance/{session}/round/{round}/arrived (`Arrived`), .../said (`Said`),
tokendance/{session}/pinned (`Pinned`), tokendance/responses/{id}/stored (`Shared`),
tokendance/conversations/{id}/stored (`Talk`) and .../deleted for either (`Dropped`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from tokendance.backend.fleet import Fleet, Key

from .conversations import Conversation
from .mqtt import PINNED, PREFIX, STORE_EVENTS, topic
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
    tenant: str  # whose session of that name (backend/fleet.py Key)


class Shared(Struct):
    """A stored response (proxy/stored.py), its encoded parts as they are."""

    origin: str
    body: msgspec.Raw
    conversation: msgspec.Raw
    inputs: msgspec.Raw
    tenant: str
    tags: tuple[str | None, str | None, str | None]


class Talk(Struct):
    """A conversation object (proxy/conversations.py), its items as they are."""

    origin: str
    tenant: str
    metadata: dict[str, str]
    created_at: int
    items: list[msgspec.Raw]
    tags: tuple[str | None, str | None, str | None]


class Dropped(Struct):
    origin: str
    tenant: str


_arrived, _said, _pinned = msgspec.json.Decoder(Arrived), msgspec.json.Decoder(Said), msgspec.json.Decoder(Pinned)
_dropped = msgspec.json.Decoder(Dropped)


@dataclass(frozen=True, slots=True)
class Kind:
    """What a kept id names, told by its form."""

    form: re.Pattern[str]
    topic: str  # tokendance/{topic}/{id}/stored (proxy/mqtt.py's KEPT)
    store: str  # the Proxy's attribute that keeps it
    decoder: msgspec.json.Decoder


KINDS = (Kind(re.compile(r"resp_[0-9a-f]{24}"), "responses", "stored", msgspec.json.Decoder(Shared)),
         Kind(re.compile(r"conv_[0-9a-f]{48}"), "conversations", "conversations", msgspec.json.Decoder(Talk)))


def kind(id: str) -> Kind:
    k = next((k for k in KINDS if k.form.fullmatch(id)), None)
    if k is None:
        raise ValueError("not a response's or a conversation's id")
    return k


class Peers:
    def __init__(self, proxy: Proxy, send: Callable[[str, bytes], None]):
        self.proxy, self.send = proxy, send  # send(topic, payload)
        self.origin = secrets.token_hex(8)
        fleet = proxy.backend
        if isinstance(fleet, Fleet):
            fleet.origin = self.origin
            fleet.on_pin = self.pinned
        proxy.stored.shared = proxy.conversations.shared = self.kept

    def arrived(self, rnd: Round, agent: str) -> None:
        self.send(topic(rnd.session, rnd.number, "arrived"), msgspec.json.encode(Arrived(agent, self.origin, rnd.owner)))

    def said(self, rnd: Round, agent: str | None, tenant: str, text: str) -> None:
        self.send(topic(rnd.session, rnd.number, "said"),
                  msgspec.json.encode(Said(text, self.origin, tenant, agent, rnd.owner)))

    def pinned(self, session: Key, engine: str, decided: tuple[float, str]) -> None:
        tenant, name = session
        self.send(f"{PREFIX}/{name}/{PINNED}", msgspec.json.encode(Pinned(engine, *decided, tenant)))

    def kept(self, id: str, s: Stored | Conversation | None, tenant: str) -> None:
        """A stored response or a conversation was put (or deleted: None) here."""
        if s is None:
            m: Struct = Dropped(self.origin, tenant)
        elif isinstance(s, Stored):
            m = Shared(self.origin, msgspec.Raw(s.body), msgspec.Raw(s.conversation), msgspec.Raw(s.inputs),
                       s.tenant, s.tags)
        else:
            m = Talk(self.origin, s.tenant, s.metadata, s.created_at, [msgspec.Raw(i) for i in s.items], s.tags)
        self.send(f"{PREFIX}/{kind(id).topic}/{id}/{'deleted' if s is None else 'stored'}", msgspec.json.encode(m))

    def handle(self, session: str, number: int, event: str, payload: bytes) -> None:
        """A peer's message (this proxy's own come back from the broker: skipped). For a
        stored response's, `session` is the response's id."""
        px = self.proxy
        if event in STORE_EVENTS:
            id, k = session, kind(session)
            m = (k.decoder if event == "stored" else _dropped).decode(payload)
            if m.origin == self.origin:
                return
            store = getattr(px, k.store)
            if isinstance(m, Dropped):
                store.delete(id, m.tenant, share=False)
            elif isinstance(m, Shared):
                store.put(id, Stored(bytes(m.body), bytes(m.conversation), bytes(m.inputs), m.tenant, m.tags),
                          share=False)
            else:
                store.put(id, Conversation(id, m.tenant, m.metadata, m.created_at, [bytes(i) for i in m.items],
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
                px.backend.adopt((p.tenant, session), p.engine, (p.at, p.origin))
