"""A live proxy on loopback with the echo backend, and the All-Gather checks."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest

from tokendance.adapters.rounds import Rounds
from tokendance.examples.echo import EchoBackend
from tokendance.examples.local import threaded

AGENTS = ["Ada", "Bo", "Cy"]
PROXY_MISSING = importlib.util.find_spec("tokendance.proxy.app") is None


@pytest.fixture(autouse=True)
def _needs_proxy() -> None:
    if PROXY_MISSING:
        pytest.skip("tokendance.proxy.app is not in this tree yet")


@pytest.fixture
def proxy_url() -> Iterator[str]:
    with threaded(EchoBackend("collective"), barrier_timeout=10.0) as url:
        yield url


@pytest.fixture
def check_rounds(proxy_url: str) -> Callable[[str, int], list[dict]]:
    """Asserts that every round of `session` formed one group of all agents, and that
    round 2 on reused shared blocks; returns the stats."""

    def check(session: str, rounds: int = 2) -> list[dict]:
        ctl = Rounds(session, proxy_url)
        stats = [ctl.stats(r) for r in range(1, rounds + 1)]
        for s in stats:
            assert s["groups"] == 1 and s["group_sizes"] == [len(AGENTS)], s
            assert s["agents"] == AGENTS and s["errors"] == 0, s
        for s in stats[1:]:
            assert s["shared_tokens"] > 0, s
            assert 0 < s["reused_tokens"] <= s["shared_tokens"], s
            assert s["kv_held_bytes"] < s["kv_dense_bytes"], s
        return stats

    return check
