"""The proxy on a socket (proxy/listen.py), with its MQTT control plane and its stats
line; stop() drains. The routes are proxy/app.py's."""

from __future__ import annotations

import structlog
from aiohttp import web

from tokendance.backend.protocol import Backend

from . import schemas
from .app import make_app
from .core import Config, Proxy, digest
from .listen import Listen
from .mqtt import Control
from .peers import Peers
from .stats_log import StatsLog

log = structlog.get_logger("tokendance.proxy")


def _mqtt_owner(px: Proxy, body: schemas.RoundOpen) -> str:
    """Whose session an MQTT open or seal names: under --api-key, its payload's `api_key`'s."""
    if not px.config.api_keys:
        return ""
    if body.api_key not in px.config.api_keys:
        raise ValueError("under --api-key an MQTT open or seal gives its session's key as api_key")
    return digest(body.api_key)


class Server:
    """The proxy on a socket, with its MQTT control plane; stop() drains."""

    def __init__(self, backend: Backend, config: Config | None = None, mqtt: str | None = None):
        self.proxy = Proxy(backend, config)
        self.control = None
        if mqtt:
            peers = None
            if self.proxy.config.peers:
                peers = self.proxy.peers = Peers(self.proxy, lambda to, payload: self.control.send(to, payload))
            px = self.proxy
            self.control = Control(mqtt, lambda s, n, body: px.open(s, n, body, _mqtt_owner(px, body)),
                                   lambda s, n, body: px.seal(s, n, _mqtt_owner(px, body)),
                                   on_peer=peers and peers.handle)
        elif self.proxy.config.peers:
            raise ValueError("--mqtt-peers shares rounds over the MQTT broker: give --mqtt too")
        self.app = make_app(self.proxy, self.control)
        c = self.proxy.config
        self.stats = StatsLog(self.proxy.metrics, backend.gauges, lambda: self.proxy.in_flight,
                              c.stats_every) if c.log_stats else None
        self.runner: web.AppRunner | None = None
        self.where = Listen()
        self.port = 0

    async def start(self, where: Listen = Listen()) -> None:
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=self.proxy.config.drain_timeout)
        await self.runner.setup()
        await where.site(self.runner).start()
        self.where = where
        if where.uds is None:
            self.port = self.runner.addresses[0][1]
        if self.control is not None:
            self.proxy.publish = self.control.publish
            self.control.start()
        if self.stats is not None:
            self.stats.start()
        at = dict(socket=where.uds) if where.uds else dict(host=where.host, port=self.port, scheme=where.scheme)
        log.info("serving", **at, model=self.proxy.names[0])

    @property
    def url(self) -> str:
        """Where a client on this host reaches it (over a Unix socket: the URL to send with
        a client that connects to the socket)."""
        if self.where.uds is not None:
            return "http://localhost"
        return f"{self.where.scheme}://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is None:
            return
        drained = await self.proxy.drain()
        await self.runner.cleanup()
        self.runner = None
        if self.stats is not None:
            await self.stats.stop()
        if self.control is not None:
            await self.control.stop()
        await self.proxy.backend.close()
        log.info("stopped", drained=drained)
