"""A request the proxy answers with a 503 and a Retry-After (it could not reach its
engine: nothing of the request ran) is sent again that much later, twice at most unless
the caller says otherwise, as the openai SDK does; by the round helper (stdlib HTTP) and
by the examples' agent client (aiohttp). Any other error is final at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokendance.adapters.rounds import ProxyError, Rounds, retry_after
from tokendance.examples.client import Client

OK = (200, {}, {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
UNREACHABLE = (503, {"Retry-After": "0.2"}, {"error": {"message": "engine unavailable: cannot reach"}})


class Script(BaseHTTPRequestHandler):
    """Answers each POST with the next of the server's `answers`; notes when it came."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.times.append(time.perf_counter())
        status, headers, body = self.server.answers.pop(0)
        raw = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(raw)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Script)
    srv.answers, srv.times = [], []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def agent_chat(srv: ThreadingHTTPServer, **kw: int) -> str:
    async def run() -> str:
        async with Client(url(srv), "s", model="m", **kw) as c:
            return (await c.chat("a", 1, [{"role": "user", "content": "x"}])).text
    return asyncio.run(run())


def batch(srv: ThreadingHTTPServer, **kw: int) -> str:
    return Rounds("s", url(srv), **kw).chats(1, {"a": [{"role": "user", "content": "x"}]}, model="m")["a"]


@pytest.mark.parametrize("send", [agent_chat, batch])
def test_a_503_with_retry_after_is_sent_again_then(server, send) -> None:
    server.answers = [UNREACHABLE, UNREACHABLE, OK]
    assert send(server) == "hi"
    gaps = [b - a for a, b in zip(server.times, server.times[1:])]
    assert len(gaps) == 2 and min(gaps) >= 0.2


@pytest.mark.parametrize("send", [agent_chat, batch])
def test_it_gives_up_after_two_retries(server, send) -> None:
    server.answers = [UNREACHABLE] * 3 + [OK]
    with pytest.raises(ProxyError, match="engine unavailable") as e:
        send(server)
    assert e.value.status == 503 and len(server.times) == 3


@pytest.mark.parametrize("send", [agent_chat, batch])
def test_the_caller_says_how_often(server, send) -> None:
    server.answers = [UNREACHABLE] * 3 + [OK]
    assert send(server, retries=3) == "hi" and len(server.times) == 4
    server.answers, server.times = [UNREACHABLE, OK], []
    with pytest.raises(ProxyError, match="engine unavailable"):
        send(server, retries=0)
    assert len(server.times) == 1


@pytest.mark.parametrize("send", [agent_chat, batch])
@pytest.mark.parametrize("answer", [
    (500, {"Retry-After": "0"}, {"error": {"message": "engine error: lost the engine"}}),
    (503, {}, {"error": {"message": "the server is shutting down"}}),
    (400, {}, {"error": {"message": "max_tokens must be at least 1"}}),
])
def test_other_errors_are_final(server, send, answer) -> None:
    server.answers = [answer, OK]
    with pytest.raises(ProxyError, match=answer[2]["error"]["message"]):
        send(server)
    assert len(server.times) == 1


def test_what_counts_as_a_retry_after() -> None:
    assert retry_after(503, {"Retry-After": "2"}) == 2.0
    assert retry_after(429, {"Retry-After": "0.5"}) == 0.5
    assert retry_after(503, {}) is None  # a proxy shutting down
    assert retry_after(503, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}) is None
    assert retry_after(503, {"Retry-After": "600"}) is None  # longer than any agent should wait
    assert retry_after(503, {"Retry-After": "-1"}) is None
    assert retry_after(500, {"Retry-After": "1"}) is None
