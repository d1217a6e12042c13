"""The All-Gather round loop: announce, every agent speaks at once, read the stats,
hand all replies to the scenario, next round. With the client's `api="batch"` a round is
one request instead (vLLM's batch of chats), with nothing to announce."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from tokendance.examples.client import Client, Reply
from tokendance.examples.scenario import Scenario

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Round:
    round: int
    replies: dict[str, Reply]
    latency: float  # seconds, first request sent to last reply read
    stats: dict[str, Any] = field(default_factory=dict)  # the proxy's round stats


async def step(scenario: Scenario, client: Client, r: int) -> Round:
    """Run round `r` of `scenario`: one barrier group of every agent."""
    recall = getattr(scenario, "recall", None)  # a scenario whose agents look up memories
    if recall is not None:
        await recall(client, r)
    prompts = {a: scenario.messages(a, r) for a in scenario.agents}
    t0 = time.perf_counter()
    if client.api == "batch":  # the round in one request: one group, no barrier to wait at
        got = await client.round(r, prompts)
    else:
        await client.rounds.aannounce(r, scenario.agents)
        t0 = time.perf_counter()
        got = await asyncio.gather(*(client.chat(a, r, m) for a, m in prompts.items()))
    latency = time.perf_counter() - t0
    replies = {rep.agent: rep for rep in got}
    stats = await client.rounds.astats(r)
    scenario.observe(r, {a: rep.text for a, rep in replies.items()})
    log.debug("round", session=client.session, round=r, latency=round(latency, 3))
    return Round(r, replies, latency, stats)


async def run(
    scenario: Scenario,
    client: Client,
    rounds: int,
    on_round: Callable[[Round], None] | None = None,
) -> list[Round]:
    """All rounds of `scenario`, in order; `on_round` hears each as it ends."""
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    done: list[Round] = []
    for r in range(1, rounds + 1):
        done.append(await step(scenario, client, r))
        if on_round is not None:
            on_round(done[-1])
    return done
