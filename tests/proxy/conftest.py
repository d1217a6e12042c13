"""Fixtures: backends (a deterministic fake; the real engine on a tiny model), live servers
on loopback, and an MQTT broker (Debian's mosquitto, or amqtt in-process where it is absent)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tokendance.backend.parallel import free_port
from tokendance.proxy.core import Config
from tokendance.proxy.listen import Listen
from tokendance.proxy.server import Server

_spec = importlib.util.spec_from_file_location("proxy_fake_backend",
                                               Path(__file__).with_name("fake_backend.py"))
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)
FakeBackend = fake.FakeBackend
_spec = importlib.util.spec_from_file_location("proxy_fake_vllm", Path(__file__).with_name("fake_vllm.py"))
fake_vllm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_vllm)


async def _until(cond: Callable[[], Any], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.fixture
def until() -> Callable[..., Any]:
    """await until(lambda: condition): poll the server's state instead of sleeping."""
    return _until


@pytest.fixture
def make_backend() -> Callable[..., FakeBackend]:
    return FakeBackend


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., Any]]:
    """start(backend, mqtt, **config) -> a running Server in this test's loop."""
    servers: list[Server] = []

    async def run(backend: Any = None, mqtt: str | None = None, **config: Any) -> Server:
        server = Server(backend if backend is not None else FakeBackend(), Config(**config), mqtt)
        await server.start(Listen(port=0))
        servers.append(server)
        return server

    yield run
    for s in servers:
        await s.stop()


@pytest.fixture
async def server(start: Callable[..., Any]) -> Server:
    return await start()


class Threaded:
    """A server on its own event loop in a thread: the sync openai SDK can call it."""

    def __init__(self, backend: Any, **config: Any):
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.server = Server(backend, Config(**config))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start(Listen(port=0)))
        self.url = self.server.url

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, key: str = "sk-test", **kw: Any) -> openai.OpenAI:
        """The sync openai SDK, pointed here, retrying nothing."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def echo() -> Iterator[Threaded]:
    """The fake backend echoing 40 words, behind a proxy that reads Qwen3 thinking."""
    t = Threaded(FakeBackend(length=40), reasoning="qwen3")
    yield t
    t.close()


@pytest.fixture(scope="module")
def client(echo: Threaded) -> openai.OpenAI:
    return echo.client()


@pytest.fixture(scope="module")
def live() -> Iterator[Threaded]:
    """The fake backend: predictable answers, so every field can be checked."""
    t = Threaded(FakeBackend())
    yield t
    t.close()


@pytest.fixture(scope="module")
def engine_live(tiny_llama: Path) -> Iterator[Threaded]:
    """The real engine on a tiny random-weight Llama (tests/conftest.py builds it)."""
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"), barrier_timeout=10.0)
    yield t
    t.close()


@pytest.fixture(scope="module")
def engine_client(engine_live) -> Any:
    """The openai SDK's client of `engine_live`."""
    return engine_live.client()


@pytest.fixture(scope="module")
def engine_model(engine_live) -> str:
    return engine_live.backend.info.name


def wait_port(port: int, up: bool = True, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            if up:
                return
        except OSError:
            if not up:
                return
        time.sleep(0.02)
    raise TimeoutError(f"port {port} did not go {'up' if up else 'down'}")


class Broker:
    """An MQTT broker on a loopback port that a test can stop and start again."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto"
                                                 if os.access("/usr/sbin/mosquitto", os.X_OK) else None)
        if os.environ.get("TOKENDANCE_TEST_BROKER") == "amqtt":
            self.exe = None
        self.kind = "mosquitto" if self.exe else "amqtt"
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        self.running: Any = None  # the mosquitto Popen, or the amqtt Broker

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    async def start(self) -> None:
        if self.exe:
            self.running = subprocess.Popen([self.exe, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
            await asyncio.to_thread(wait_port, self.port)
        else:
            from amqtt.broker import Broker as AmqttBroker

            self.running = AmqttBroker({
                "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
                "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}})
            await self.running.start()

    async def stop(self) -> None:
        running, self.running = self.running, None
        if isinstance(running, subprocess.Popen):
            running.terminate()  # by pid: only the broker this fixture started
            await asyncio.to_thread(running.wait, 10)
            await asyncio.to_thread(wait_port, self.port, False)
        elif running is not None:
            await running.shutdown()


@pytest.fixture
async def idle_broker(tmp_path: Path) -> AsyncIterator[Broker]:
    """A broker that is not started yet."""
    b = Broker(tmp_path)
    yield b
    await b.stop()


@pytest.fixture
async def broker(idle_broker: Broker) -> Broker:
    await idle_broker.start()
    return idle_broker


@pytest.fixture
async def vllm(tiny_llama) -> Any:
    """A fake vLLM server (fake_vllm.py) serving the tiny model's tokenizer."""
    fake = await fake_vllm.served(fake_vllm.FakeVLLM(str(tiny_llama)))
    yield fake
    await fake.runner.cleanup()


@pytest.fixture
async def proxy(vllm, start) -> Any:
    """The proxy over `vllm`."""
    from tokendance.backend.vllm import VLLMBackend

    return await start(await VLLMBackend.connect(vllm.url))
