"""OpenAI's Conversations API (`/v1/conversations`): a conversation's items kept by the
server, which a response continues when its request names it (`conversation` in
`POST /v1/responses`: proxy/app.py), its input and output items then added to it.

A conversation belongs to the API key that made it (another key's ids are a 404) and is
kept in memory, its items encoded, within the same kind of LRU budget as stored
responses (proxy/stored.py). Items are added 20 at most at a time, as in OpenAI's API;
a response's items are added when it ends (completed or incomplete), not when it fails.
A response with no session of its own stays in the session and agent of the last
response of its conversation.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from msgspec import Struct

from .errors import ApiError, invalid
from .responses import Item, check_metadata, listed, messages
from .schemas import Message, decode

if TYPE_CHECKING:
    from .core import Proxy

MAX_ADDED = 20  # items one request may add
_item = msgspec.json.Decoder(Item)


class Created(Struct, kw_only=True):
    items: list[Item] | None = None
    metadata: dict[str, str] | None = None


class Added(Struct, kw_only=True):
    items: list[Item]


class Updated(Struct, kw_only=True):
    metadata: dict[str, str]


@dataclass(slots=True)
class Conversation:
    id: str
    tenant: str
    metadata: dict[str, str]
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[bytes] = field(default_factory=list)  # each as listed back, encoded
    tags: tuple[str | None, str | None, str | None] = (None, None, None)  # its last response's session, agent, mode
    size: int = 0

    def weight(self) -> int:
        return sum(map(len, self.items)) + len(msgspec.json.encode(self.metadata)) + 64

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def history(self) -> list[Message]:
        """Its items as the chat messages a response continues."""
        items = [_item.decode(i) for i in self.items]
        return messages(items) if items else []


def add(px: Proxy, c: Conversation, items: list[dict[str, Any]]) -> None:
    """Add listed items to `c` (the store weighs it again)."""
    c.items += [msgspec.json.encode(i) for i in items]
    px.conversations.put(c.id, c)


def find(px: Proxy, id: str, owner: str, param: str = "conversation_id") -> Conversation:
    c = px.conversations.get(id, owner)
    if c is None:
        raise _missing(id, param)
    return c


def _missing(id: str, param: str = "conversation_id") -> ApiError:
    return ApiError(404, f"Conversation with id {id!r} not found.", param, "conversation_not_found")


def page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """A page of a list of items, as OpenAI's lists give them (`limit` 1-100, `order` desc
    (the default) or asc, `after` an item's id)."""
    limit = query.get("limit", "20")
    if not (limit.isdecimal() and 1 <= int(limit) <= 100):
        raise invalid("limit must be an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be asc or desc", "order")
    if order == "desc":
        items = items[::-1]
    if "after" in query:
        at = next((i for i, it in enumerate(items) if it["id"] == query["after"]), None)
        if at is None:
            raise invalid(f"no item {query['after']!r} in this list", "after")
        items = items[at + 1:]
    got = items[:int(limit)]
    return {"object": "list", "data": got, "first_id": got[0]["id"] if got else None,
            "last_id": got[-1]["id"] if got else None, "has_more": len(items) > len(got)}


def _added(items: list[Item]) -> list[dict[str, Any]]:
    if len(items) > MAX_ADDED:
        raise invalid(f"at most {MAX_ADDED} items may be added at a time", "items")
    if items:
        messages(items, "items")  # what no response could continue is refused now
    return listed(items) if items else []


def routes(r: web.UrlDispatcher, px: Proxy) -> None:
    async def create(req: web.Request) -> web.Response:
        body = decode(await req.read(), Created)
        meta = body.metadata or {}
        check_metadata(meta)
        c = Conversation("conv_" + secrets.token_hex(24), px.tenant(req.headers), meta)
        add(px, c, _added(body.items or []))
        return _json(c.view())

    async def get(req: web.Request) -> web.Response:
        return _json(find(px, req.match_info["id"], px.tenant(req.headers)).view())

    async def update(req: web.Request) -> web.Response:
        c = find(px, req.match_info["id"], px.tenant(req.headers))
        body = decode(await req.read(), Updated)
        check_metadata(body.metadata)
        c.metadata = body.metadata
        px.conversations.put(c.id, c)
        return _json(c.view())

    async def delete(req: web.Request) -> web.Response:
        id = req.match_info["id"]
        if not px.conversations.delete(id, px.tenant(req.headers)):
            raise _missing(id)
        return _json({"id": id, "object": "conversation.deleted", "deleted": True})

    async def list_items(req: web.Request) -> web.Response:
        c = find(px, req.match_info["id"], px.tenant(req.headers))
        return _json(page([msgspec.json.decode(i) for i in c.items], req.query))

    async def add_items(req: web.Request) -> web.Response:
        c = find(px, req.match_info["id"], px.tenant(req.headers))
        new = _added(decode(await req.read(), Added).items)
        add(px, c, new)
        return _json({"object": "list", "data": new, "first_id": new[0]["id"] if new else None,
                      "last_id": new[-1]["id"] if new else None, "has_more": False})

    def _at(c: Conversation, item_id: str) -> int:
        for i, raw in enumerate(c.items):
            if msgspec.json.decode(raw)["id"] == item_id:
                return i
        raise ApiError(404, f"Item with id {item_id!r} not found.", "item_id", "item_not_found")

    async def get_item(req: web.Request) -> web.Response:
        c = find(px, req.match_info["id"], px.tenant(req.headers))
        return web.Response(body=c.items[_at(c, req.match_info["item"])], content_type="application/json")

    async def delete_item(req: web.Request) -> web.Response:
        c = find(px, req.match_info["id"], px.tenant(req.headers))
        del c.items[_at(c, req.match_info["item"])]
        px.conversations.put(c.id, c)
        return _json(c.view())

    base = "/v1/conversations"
    r.add_post(base, create)
    r.add_get(base + "/{id}", get)
    r.add_post(base + "/{id}", update)
    r.add_delete(base + "/{id}", delete)
    r.add_get(base + "/{id}/items", list_items)
    r.add_post(base + "/{id}/items", add_items)
    r.add_get(base + "/{id}/items/{item}", get_item)
    r.add_delete(base + "/{id}/items/{item}", delete_item)


def _json(obj: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
