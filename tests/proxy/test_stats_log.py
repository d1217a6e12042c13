"""vLLM's periodic stats line (--disable-log-stats turns it off): throughput of what was
answered, reuse, the engine's queues and its KV pool, while the server is busy; an
idle server logs nothing."""

from __future__ import annotations

import asyncio

import openai
import structlog

from tokendance.backend.protocol import Gauge
from tokendance.proxy import serve
from tokendance.proxy.stats import Metrics
from tokendance.proxy.stats_log import StatsLog

from .test_serve import parse


def stats(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "stats"]


async def test_a_busy_server_logs_its_stats_and_an_idle_one_does_not(start):
    server = await start(stats_every=0.05)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    with structlog.testing.capture_logs() as logs:
        await asyncio.sleep(0.2)  # idle: nothing
        assert stats(logs) == []
        await client.completions.create(model="fake-tiny", prompt="hello there", max_tokens=5)
        await asyncio.sleep(0.2)
        busy = len(stats(logs))
        await asyncio.sleep(0.2)  # idle again: no more lines
        assert len(stats(logs)) == busy
    answered = [e for e in stats(logs) if e["prompt_throughput"] > 0]
    assert len(answered) == 1 and answered[0]["generation_throughput"] > 0
    assert answered[0]["in_flight"] == 0 and answered[0]["running"] == 0


async def test_none_under_disable_log_stats(start):
    server = await start(stats_every=0.05, log_stats=False)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    with structlog.testing.capture_logs() as logs:
        await client.completions.create(model="fake-tiny", prompt="hello there", max_tokens=5)
        await asyncio.sleep(0.2)
    assert server.stats is None and stats(logs) == []


def test_the_line_reads_the_engine_gauges_and_the_answered_tokens():
    m = Metrics()
    gauges = [Gauge("kv_blocks", "", 100), Gauge("kv_blocks_free", "", 75), Gauge("sequences_running", "", 3),
              Gauge("sequences_waiting", "", 2)]
    log = StatsLog(m, lambda: gauges, lambda: 5)
    for kind, n in (("prompt", 400), ("completion", 50), ("cached", 300)):
        m.tokens.inc(n, kind=kind)
    with structlog.testing.capture_logs() as logs:
        log.tick()
    line, = stats(logs)
    assert (line["running"], line["waiting"], line["in_flight"], line["kv_usage"], line["reused"]) == \
        (3, 2, 5, "25.0%", "75.0%")
    assert line["prompt_throughput"] > line["generation_throughput"] > 0


def test_the_flag():
    assert serve.config(parse()).log_stats and not serve.config(parse("--disable-log-stats")).log_stats
