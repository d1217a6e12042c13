"""vLLM's periodic stats line (off with --disable-log-stats): every `every` seconds while
the server is busy, the prompt and generation throughput of the requests answered since
the last line, what share of their prompts reused KV, the engine's running and waiting
requests and how full its KV pool is. An idle server logs nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from tokendance.backend.protocol import Gauge

from .stats import Metrics

log = structlog.get_logger("tokendance.stats")
KINDS = ("prompt", "completion", "cached")


class StatsLog:
    def __init__(self, metrics: Metrics, gauges: Callable[[], list[Gauge]], in_flight: Callable[[], int],
                 every: float = 10.0):
        self.metrics, self.gauges, self.in_flight, self.every = metrics, gauges, in_flight, every
        self.task: asyncio.Task | None = None
        self._last = (time.monotonic(), self._counts())

    def start(self) -> None:
        self._last = (time.monotonic(), self._counts())
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.tick()

    def _counts(self) -> dict[str, float]:
        values = self.metrics.tokens.values
        return {k: values.get((("kind", k),), 0.0) for k in KINDS}

    def tick(self) -> None:
        """One line, if anything was answered since the last or is being served now."""
        now, counts = time.monotonic(), self._counts()
        then, before = self._last
        self._last = now, counts
        done = {k: counts[k] - before[k] for k in KINDS}
        engine = {}
        for g in self.gauges():  # a fleet gives each once per engine: summed
            engine[g.name] = engine.get(g.name, 0.0) + g.value
        running, waiting = int(engine.get("sequences_running", 0)), int(engine.get("sequences_waiting", 0))
        busy = self.in_flight()
        if not any(done.values()) and not busy and not running and not waiting:
            return
        span = max(now - then, 1e-9)
        blocks = engine.get("kv_blocks", 0.0)
        usage = 1 - engine.get("kv_blocks_free", blocks) / blocks if blocks else None
        log.info("stats", prompt_throughput=round(done["prompt"] / span, 1),
                 generation_throughput=round(done["completion"] / span, 1),
                 reused=f"{done['cached'] / done['prompt']:.1%}" if done["prompt"] else None,
                 in_flight=busy, running=running, waiting=waiting,
                 kv_usage=None if usage is None else f"{usage:.1%}")
