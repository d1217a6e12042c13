"""Round statistics and Prometheus metrics (text format 0.0.4, no client library)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from tokendance.backend.api import Usage
from tokendance.backend.protocol import Gauge


@dataclass(slots=True)
class RoundStats:
    """What GET .../rounds/{round} returns and MQTT .../done publishes."""

    requests: int = 0  # answered (including errors and aborts)
    errors: int = 0
    aborted: int = 0
    group_sizes: list[int] = field(default_factory=list)  # in sequences (prompts times n)
    prompt_tokens: int = 0
    shared_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0
    kv_dense_bytes: int = 0
    kv_held_bytes: int = 0
    shared_blocks: set[int] = field(default_factory=set)  # read by its requests, held once
    block_bytes: int = 0
    per_agent: dict[str, list[int]] = field(default_factory=dict)  # agent: AGENT_FIELDS
    wait_max: float = 0.0
    wait_sum: float = 0.0
    latency_max: float = 0.0
    latency_sum: float = 0.0
    first: float = 0.0  # perf_counter of the first arrival
    last: float = 0.0  # perf_counter of the last finish

    def add(self, usage: Usage | None, wait: float, latency: float, outcome: str,
            agent: str | None = None) -> int:
        """Count one answered request; returns how many of the blocks it read without
        holding them no earlier request of the round had read."""
        self.requests += 1
        self.errors += outcome == "error"
        self.aborted += outcome == "abort"
        self.wait_max = max(self.wait_max, wait)
        self.wait_sum += wait
        self.latency_max = max(self.latency_max, latency)
        self.latency_sum += latency
        if usage is None:
            return 0
        self.prompt_tokens += usage.prompt_tokens
        self.shared_tokens += usage.shared_tokens
        self.reused_tokens += usage.cached_tokens
        self.recomputed_tokens += usage.recomputed_tokens
        self.completion_tokens += usage.completion_tokens
        self.kv_dense_bytes += usage.kv_dense_bytes
        self.kv_held_bytes += usage.kv_held_bytes
        before = len(self.shared_blocks)
        self.shared_blocks.update(usage.shared_blocks)
        self.block_bytes = self.block_bytes or usage.block_bytes
        if agent is not None:
            self.credit(agent, usage)
        return len(self.shared_blocks) - before

    def credit(self, agent: str, usage: Usage) -> None:
        """Count `usage` in `agent`'s row."""
        mine = self.per_agent.setdefault(agent, [0] * len(AGENT_FIELDS))
        for i, (_, attr) in enumerate(AGENT_FIELDS):
            mine[i] += getattr(usage, attr)

    def view(self, session: str, number: int, agents: set[str], expected: frozenset[str] | None,
             sealed: bool, active: int) -> dict[str, Any]:
        n = max(self.requests, 1)
        shared = len(self.shared_blocks) * self.block_bytes
        held = self.kv_held_bytes + shared
        return {
            "session": session, "round": number, "agents": sorted(agents),
            "expected": sorted(expected) if expected is not None else None,
            "sealed": sealed, "active": active, "requests": self.requests,
            "errors": self.errors, "aborted": self.aborted,
            "groups": len(self.group_sizes), "group_sizes": self.group_sizes,
            "prompt_tokens": self.prompt_tokens, "shared_tokens": self.shared_tokens,
            "reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
            "completion_tokens": self.completion_tokens,
            "kv_dense_bytes": self.kv_dense_bytes, "kv_held_bytes": self.kv_held_bytes,
            "kv_shared_bytes": shared, "kv_ratio": round(self.kv_dense_bytes / held, 3) if held else None,
            "per_agent": {a: _agent(v) for a, v in sorted(self.per_agent.items())},
            "barrier_wait_ms": round(self.wait_max * 1e3, 3),
            "barrier_wait_ms_mean": round(self.wait_sum / n * 1e3, 3),
            "latency_ms": round(max(self.last - self.first, 0.0) * 1e3, 3),
            "request_latency_ms_mean": round(self.latency_sum / n * 1e3, 3),
            "request_latency_ms_max": round(self.latency_max * 1e3, 3),
        }


# Per agent in a round's stats: (key, Usage attribute), summed over its requests.
AGENT_FIELDS = (("prompt_tokens", "prompt_tokens"), ("reused_tokens", "cached_tokens"),
                ("recomputed_tokens", "recomputed_tokens"), ("completion_tokens", "completion_tokens"),
                ("kv_dense_bytes", "kv_dense_bytes"), ("kv_held_bytes", "kv_held_bytes"))


def _agent(values: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {key: v for (key, _), v in zip(AGENT_FIELDS, values)}
    held = out["kv_held_bytes"]
    out["kv_ratio"] = round(out["kv_dense_bytes"] / held, 3) if held else None
    return out


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    esc = {ord("\\"): "\\\\", ord('"'): '\\"', ord("\n"): "\\n"}  # Prometheus' escapes
    return "{" + ",".join(f'{k}="{v.translate(esc)}"' for k, v in labels) + "}"


class Metric:
    def __init__(self, name: str, help: str, kind: str):
        self.name, self.help, self.kind = name, help, kind
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, by: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + by

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{self.name}{_labels(k)} {v:g}" for k, v in self.values.items()]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum:g}", f"{self.name}_count {total}"]


SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TOKEN_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5]


class Metrics:
    def __init__(self) -> None:
        c, g = "counter", "gauge"
        self.requests = Metric("tokendance_requests_total", "HTTP requests answered", c)
        self.in_flight = Metric("tokendance_requests_in_flight", "requests being served", g)
        self.waiting = Metric("tokendance_barrier_waiting", "requests held at a barrier", g)
        self.groups = Metric("tokendance_groups_total", "groups sent to the backend", c)
        self.tokens = Metric("tokendance_tokens_total", "tokens by kind", c)
        self.kv_bytes = Metric("tokendance_kv_bytes_total",
                               "KV of answered requests: dense (a per-request cache), held (privately), "
                               "shared (blocks they read, once per round)", c)
        self.aborted = Metric("tokendance_aborted_total", "requests aborted by a client disconnect", c)
        self.engine_errors = Metric("tokendance_engine_errors_total",
                                    "groups or streams failed by the engine", c)
        self.mqtt = Metric("tokendance_mqtt_connected", "1 while connected to the MQTT broker", g)
        self.stored = Metric("tokendance_responses_stored", "stored responses of the Responses API", g)
        self.stored_bytes = Metric("tokendance_responses_stored_bytes", "what they hold, encoded", g)
        self.wait = Histogram("tokendance_barrier_wait_seconds", "time held at the barrier", SECONDS)
        self.latency = Histogram("tokendance_request_seconds", "arrival to last byte", SECONDS)
        self.ttft = Histogram("tokendance_time_to_first_token_seconds",
                              "arrival to the first token (the barrier's hold included)", SECONDS)
        self.tpot = Histogram("tokendance_time_per_output_token_seconds",
                              "first token to last, per token after the first (answered requests)", TOKEN_SECONDS)
        self.overhead = Histogram("tokendance_proxy_overhead_seconds",
                                  "request time spent in the proxy itself", SECONDS)
        self.group_size = Histogram("tokendance_group_size", "sequences per group (prompts times n)",
                                    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])

    def render(self, gauges: list[Gauge] = ()) -> str:
        """The proxy's metrics, then the backend's `gauges` as tokendance_engine_*."""
        lines: list[str] = []
        for m in vars(self).values():
            lines += m.render()
        engine: dict[str, Metric] = {}  # a fleet's engines give each name once per engine
        for g in gauges:
            m = engine.setdefault(g.name, Metric(f"tokendance_engine_{g.name}", g.help, g.kind))
            m.set(g.value, **g.labels)
        for m in engine.values():
            lines += m.render()
        return "\n".join(lines) + "\n"
