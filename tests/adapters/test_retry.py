"""Our clients send a request again as the openai SDK would (adapters/retry.py): a 503
with a Retry-After (the proxy could not reach its engine: nothing of the request ran)
that much later, a 5xx without one after a backoff, twice at most unless the caller says
otherwise; by the round helper (stdlib HTTP) and by the examples' agent client
(aiohttp). A 4xx is final at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokendance.adapters.retry import backoff
from tokendance.adapters.rounds import ProxyError, Rounds
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
def test_a_5xx_that_names_no_wait_is_sent_again_after_a_backoff(server, send) -> None:
    server.answers = [(500, {}, {"error": {"message": "engine error: lost the engine"}}),
                      (503, {}, {"error": {"message": "the server is shutting down"}}), OK]
    assert send(server) == "hi"
    first, second = (b - a for a, b in zip(server.times, server.times[1:]))
    assert 0.375 <= first < 0.75 <= second < 1.5  # 0.5 s, then 1 s, less up to a quarter


@pytest.mark.parametrize("send", [agent_chat, batch])
@pytest.mark.parametrize("answer", [
    (400, {}, {"error": {"message": "max_tokens must be at least 1"}}),
    (404, {}, {"error": {"message": "the model `m` does not exist"}}),
    (503, {"x-should-retry": "false"}, {"error": {"message": "not now, not later"}}),
    (503, {"Retry-After": "600"}, {"error": {"message": "come back in ten minutes"}}),
])
def test_other_answers_are_final(server, send, answer) -> None:
    server.answers = [answer, OK]
    with pytest.raises(ProxyError, match=answer[2]["error"]["message"]):
        send(server)
    assert len(server.times) == 1


def test_what_the_wait_is() -> None:
    assert backoff(503, {"Retry-After": "2"}, 0) == 2.0
    assert backoff(429, {"Retry-After": "0.5"}, 5) == 0.5
    assert 0.375 <= backoff(503, {}, 0) <= 0.5  # a proxy shutting down, as the SDK would
    assert 6.0 <= backoff(500, {}, 10) <= 8.0
    assert 0.75 <= backoff(502, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, 1) <= 1.0
    assert backoff(408, {}, 0) and backoff(409, {}, 0) and backoff(400, {"x-should-retry": "true"}, 0)
    assert backoff(503, {"Retry-After": "121"}, 0) is None  # longer than the SDK waits
    assert backoff(500, {"x-should-retry": "false"}, 0) is None
    assert backoff(400, {"Retry-After": "1"}, 0) is None
