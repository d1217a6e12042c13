"""When our clients send a request again (adapters/rounds.py's helper, the examples'
agents): as the openai SDK does, so an agent behaves the same through either.

A 408, 409, 429 or 5xx answer is sent again, `RETRIES` times by default: after the wait
its Retry-After names (the proxy's 503 for an engine it could not reach: nothing of the
request ran), else after 0.5 s doubling up to 8 s, less up to a quarter at random. A
Retry-After over two minutes, an `x-should-retry: false`, and any other status are
final. (The proxy's barrier holds a failed group's first retry for the others: they go
as one group again.)
"""

from __future__ import annotations

import random
from typing import Any

RETRIES = 2  # the openai SDK's default
MAX_WAIT = 120.0  # seconds: a longer Retry-After is final
FIRST, MOST = 0.5, 8.0  # the backoff's first and longest wait, in seconds


def backoff(status: int, headers: Any, attempt: int) -> float | None:
    """Seconds to wait before sending again a request whose try `attempt` (0 the first)
    was answered `status` with `headers`; None: the answer is final."""
    said = headers.get("x-should-retry")
    if said == "false" or said != "true" and not (status in (408, 409, 429) or status >= 500):
        return None
    try:
        wait = float(headers.get("Retry-After", ""))
    except ValueError:  # absent, or an HTTP date
        wait = -1.0
    if wait > MAX_WAIT:
        return None
    if wait > 0:
        return wait
    return min(FIRST * 2 ** min(attempt, 30), MOST) * (1 - 0.25 * random.random())
