"""Stored responses: what `previous_response_id` continues, and what
`GET /v1/responses/{id}` returns.

In memory, per tenant (another API key finds nothing: a 404, as for an unknown id),
evicted least recently used beyond a byte budget. A response is stored once it is done,
unless its request said `store: false`; one that failed is not, except in the background
(its status is how the client learns it failed). All is kept encoded, and the budget
counts the bytes held exactly: the body, the conversation, the input items and a
streamed background response's events (proxy/feed.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import msgspec
import structlog

from .feed import Feed
from .schemas import Message

log = structlog.get_logger("tokendance.proxy")


_history = msgspec.json.Decoder(list[Message])


@dataclass(slots=True)
class Stored:
    body: bytes  # the response object, encoded
    conversation: bytes  # without instructions, this answer last, encoded
    inputs: bytes  # its input items as listed back, encoded
    tenant: str
    tags: tuple[str | None, str | None, str | None]  # its session, agent and mode: the next inherits them
    feed: Feed | None = None  # a streamed background response's events (proxy/feed.py)
    size: int = 0

    @property
    def history(self) -> list[Message]:
        return _history.decode(self.conversation)

    def weight(self) -> int:
        return len(self.body) + len(self.conversation) + len(self.inputs) + (self.feed.size if self.feed else 0)


class Kept(Protocol):
    tenant: str
    size: int

    def weight(self) -> int: ...


K = TypeVar("K", bound=Kept)


class Store(Generic[K]):
    """Stored responses, or anything else kept so, by id and tenant, that weighs its bytes
    (conversations: proxy/conversations.py)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: OrderedDict[str, K] = OrderedDict()
        self.bytes = 0
        # told of each put (what was put) and delete (None, its tenant): peers (proxy/peers.py)
        self.shared: Callable[[str, K | None, str], None] | None = None

    def put(self, id: str, s: K, share: bool = True) -> None:
        """Keep `s` (again: what is put once more is weighed once more)."""
        self.delete(id, s.tenant, share=False)  # by the size it had
        s.size = s.weight()
        if s.size > self.budget:
            log.warning("not stored: larger than the store", id=id, bytes=s.size, budget=self.budget)
            return
        self.items[id] = s
        self.bytes += s.size
        while self.bytes > self.budget:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.size
        if share and self.shared is not None:
            self.shared(id, s, s.tenant)

    def get(self, id: str, tenant: str) -> K | None:
        s = self.items.get(id)
        if s is None or s.tenant != tenant:
            return None
        self.items.move_to_end(id)
        return s

    def delete(self, id: str, tenant: str, share: bool = True) -> bool:
        s = self.items.get(id)
        if s is None or s.tenant != tenant:
            return False
        del self.items[id]
        self.bytes -= s.size
        if share and self.shared is not None:
            self.shared(id, None, tenant)
        return True
