"""N-gram drafts (vLLM's speculative_config, method "ngram"): the config and the lookup,
plain Python (the proxy validates the flag without loading torch). backend/speculate.py
feeds the drafts and keeps what the model agrees with."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from tokendance.backend.api import InvalidRequest

FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
MAX_TOKENS = 64  # drafts a step: past this the step's extra rows cost more than any match saves


@dataclass(frozen=True, slots=True)
class Speculation:
    tokens: int  # num_speculative_tokens: a request's drafts a step, at most
    lookup_min: int = 5  # vLLM's defaults when neither is given; one given sets the other
    lookup_max: int = 5

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> Speculation | None:
        """vLLM's speculative_config (None: off); InvalidRequest for what this engine does not do."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise _bad(f"a JSON object, not {type(raw).__name__}")
        if unknown := [k for k in raw if k not in FIELDS]:
            raise _bad(f"unknown field {unknown[0]!r}; this engine takes {', '.join(FIELDS)}")
        method = raw.get("method", "ngram")
        if method != "ngram":
            raise _bad(f"method {method!r} needs a draft model or heads this engine does not run; it speculates "
                       "by n-gram lookup alone (method \"ngram\")")
        k = _count(raw, "num_speculative_tokens", required=True)
        if k > MAX_TOKENS:
            raise _bad(f"num_speculative_tokens {k} is over {MAX_TOKENS}")
        lo, hi = _count(raw, "prompt_lookup_min"), _count(raw, "prompt_lookup_max")
        lo, hi = lo or hi or 5, hi or lo or 5
        if lo > hi:
            raise _bad(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(k, lo, hi)


def _bad(why: str) -> InvalidRequest:
    return InvalidRequest(f"speculative_config: {why}", "speculative_config")


def _count(raw: dict[str, Any], name: str, required: bool = False) -> int | None:
    v = raw.get(name)
    if v is None and not required:
        return None
    if type(v) is not int or v < 1:
        raise _bad(f"{name} must be a positive integer, not {v!r}")
    return v


def propose(tokens: list[int], spec: Speculation, room: int) -> list[int]:
    """Up to min(spec.tokens, room) tokens following the earliest earlier occurrence of the
    longest suffix of `tokens` between the lookup lengths; [] when none occurs."""
    k = min(spec.tokens, room)
    if k <= 0 or len(tokens) <= spec.lookup_min:
        return []
    data = array("i", tokens).tobytes()  # bytes.find searches in C; a match must start on a token
    end = 4 * (len(tokens) - 1)  # an occurrence with a token after it
    for n in range(min(spec.lookup_max, len(tokens) - 1), spec.lookup_min - 1, -1):
        pattern = data[-4 * n:]
        at = data.find(pattern, 0, end)
        while at % 4 and at >= 0:
            at = data.find(pattern, at + 1, end)
        if at >= 0:
            start = at // 4 + n
            return tokens[start:start + k]
    return []
