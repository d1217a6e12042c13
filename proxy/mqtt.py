"""MQTT control plane: open and seal rounds, publish each round's stats when it is done.

Subscribes tokendance/+/round/+/open (payload: JSON {"agents": [...], "timeout_ms": ..},
or empty) and tokendance/+/round/+/seal; publishes tokendance/{session}/round/{round}/done.
Under --api-key, open and seal name their session's key in the payload (`"api_key"`):
each key's sessions are its own (proxy/session.py).
With peers (proxy/peers.py) it also carries .../arrived, .../said and
tokendance/{session}/pinned between proxies.
The proxy starts without a broker and reconnects whenever the broker goes away; done
messages published meanwhile wait in a bounded queue. Open and seal are commands, not
state: a retained one, which the broker replays on every (re)subscribe, is ignored, or a
restarted proxy would seal its new rounds with the last run's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiomqtt
import msgspec
import structlog

from .schemas import RoundOpen

log = structlog.get_logger("tokendance.proxy.mqtt")

PREFIX = "tokendance"
MAX_PAYLOAD = 2**20  # an open's agent list; a larger one is refused, not decoded
PEER_EVENTS = ("arrived", "said")  # between proxies, with --mqtt-peers (proxy/peers.py)
PINNED = "pinned"  # tokendance/{session}/pinned: the engine a proxy put a session on (same)
# tokendance/responses/{id}/stored, tokendance/conversations/{id}/deleted, ... (same)
KEPT, STORE_EVENTS = ("responses", "conversations"), ("stored", "deleted")
SETTLE = 1.0  # seconds a connection cancelled while being made may take to finish, to be closed
STOP_AGAIN = 2.0  # seconds stop() waits before cancelling the control task again


def topic(session: str, number: int, event: str) -> str:
    return f"{PREFIX}/{session}/round/{number}/{event}"


def address(url: str) -> tuple[str, int, str | None, str | None]:
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as exc:  # 'Port out of range 0-65535' would not say which flag
        raise ValueError(f"--mqtt: expected mqtt://host:port, got {url!r} ({exc})") from None
    if u.scheme not in ("mqtt", "tcp") or not u.hostname:
        raise ValueError(f"--mqtt: expected mqtt://host:port, got {url!r}")
    return u.hostname, port or 1883, u.username, u.password


class Control:
    def __init__(self, url: str, on_open: Callable[[str, int, RoundOpen], None],
                 on_seal: Callable[[str, int, RoundOpen], None], backoff: tuple[float, float] = (0.2, 5.0),
                 on_peer: Callable[[str, int, str, bytes], None] | None = None):
        self.host, self.port, self.user, self.password = address(url)
        self.on_open, self.on_seal = on_open, on_seal
        self.on_peer = on_peer  # the other proxies' arrived / said (proxy/peers.py)
        self.backoff = backoff
        self.connected = False
        self.outbox: deque[tuple[str, bytes]] = deque(maxlen=1000)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._decoder = msgspec.json.Decoder(RoundOpen)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        # Python 3.11's asyncio.wait_for, which aiomqtt awaits in, returns the result of a
        # future completing in the moment the task is cancelled and drops the cancellation
        # (fixed in 3.12): cancel again until the task ends.
        while not task.done():
            task.cancel()
            try:
                await asyncio.wait({task}, timeout=STOP_AGAIN)
            except asyncio.CancelledError:  # stop() itself was cancelled
                task.cancel()
                raise
        if not task.cancelled() and task.exception() is not None:
            log.error("mqtt control ended", error=repr(task.exception()))

    def publish(self, session: str, number: int, stats: dict[str, Any]) -> None:
        self.send(topic(session, number, "done"), msgspec.json.encode(stats))

    def send(self, to: str, payload: bytes) -> None:
        self.outbox.append((to, payload))
        self._wake.set()

    async def _run(self) -> None:
        delay, warned = self.backoff[0], False  # one warning per outage, not per retry
        while True:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    c = await self._connect(stack)
                    self.connected, delay, warned = True, self.backoff[0], False
                    log.info("mqtt connected", host=self.host, port=self.port)
                    sender = asyncio.create_task(self._send(c))
                    try:
                        async for msg in c.messages:
                            if msg.retain:  # a stale command replayed on (re)subscribe
                                log.warning("mqtt retained control message ignored: publish "
                                            "open and seal without retain", topic=str(msg.topic))
                                continue
                            self._handle(str(msg.topic), bytes(msg.payload or b""))
                    finally:
                        sender.cancel()
            except aiomqtt.MqttError as exc:
                if asyncio.current_task().cancelling():  # stop(): aiomqtt turned it into its own error
                    raise asyncio.CancelledError from exc
                if not warned:
                    log.warning("mqtt disconnected" if self.connected else "mqtt broker unreachable, retrying",
                                host=self.host, port=self.port, error=str(exc))
                    warned = True
            self.connected = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff[1])

    async def _connect(self, stack: contextlib.AsyncExitStack) -> aiomqtt.Client:
        """A connected, subscribed client, which `stack` disconnects. aiomqtt leaves a
        connection it is cancelled in the middle of making open, and pinging the broker,
        for the life of the process (and logs a traceback for a subscription acknowledged
        after its call was cancelled): a cancellation here lets both finish first (a
        moment), so the connection closes."""
        entering = asyncio.ensure_future(self._subscribed(stack))
        try:
            return await asyncio.shield(entering)
        except asyncio.CancelledError:
            await asyncio.wait({entering}, timeout=SETTLE)
            if not entering.done():  # a broker that does not answer: give up on it
                entering.cancel()
            elif not entering.cancelled():
                entering.exception()  # retrieved: a failed connection is no news when stopping
            raise

    async def _subscribed(self, stack: contextlib.AsyncExitStack) -> aiomqtt.Client:
        c = await stack.enter_async_context(aiomqtt.Client(
            self.host, self.port, username=self.user, password=self.password, keepalive=10,
            identifier=f"tokendance-{secrets.token_hex(4)}"))
        await c.subscribe(f"{PREFIX}/+/round/+/open", qos=1)
        await c.subscribe(f"{PREFIX}/+/round/+/seal", qos=1)
        if self.on_peer is not None:
            for event in PEER_EVENTS:
                await c.subscribe(f"{PREFIX}/+/round/+/{event}", qos=1)
            await c.subscribe(f"{PREFIX}/+/{PINNED}", qos=1)
            for kind in KEPT:
                await c.subscribe(f"{PREFIX}/{kind}/+/+", qos=1)
        return c

    async def _send(self, c: aiomqtt.Client) -> None:
        try:
            while True:
                while self.outbox:
                    t, payload = self.outbox[0]
                    await c.publish(t, payload, qos=1)
                    self.outbox.popleft()  # only once the broker has it
                self._wake.clear()
                await self._wake.wait()
        except aiomqtt.MqttError:
            pass  # the receive loop sees the disconnect and reconnects

    def _handle(self, t: str, payload: bytes) -> None:
        parts = t.split("/")
        try:
            if len(payload) > MAX_PAYLOAD:
                raise ValueError(f"payload over {MAX_PAYLOAD} bytes")
            if len(parts) == 3 and parts[2] == PINNED and self.on_peer is not None:
                self.on_peer(parts[1], 0, PINNED, payload)
                return
            if len(parts) == 4 and parts[1] in KEPT and parts[3] in STORE_EVENTS and self.on_peer is not None:
                self.on_peer(parts[2], 0, parts[3], payload)  # the id where a session goes
                return
            raw = parts[3]  # plain ASCII digits: int() also takes ' 7', '1_0', '\u0663'
            if len(parts) != 5 or not (raw.isascii() and raw.isdecimal()) or len(raw) > 4000:
                raise ValueError("round must be a non-negative integer")
            number = int(raw)
            if parts[4] in ("open", "seal"):
                body = self._decoder.decode(payload) if payload.strip() else RoundOpen()
                (self.on_open if parts[4] == "open" else self.on_seal)(parts[1], number, body)
            elif parts[4] in PEER_EVENTS and self.on_peer is not None:
                self.on_peer(parts[1], number, parts[4], payload)
        except Exception as exc:  # a bad control message must not stop the loop
            log.warning("mqtt message ignored", topic=t, error=str(exc))
