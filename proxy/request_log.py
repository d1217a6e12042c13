"""vLLM's --enable-log-requests: a line for each request the engine is given, under the
answer's id, with its prompt (text or token ids, each cut to --max-log-len) and the
sampling parameters it sets past their defaults."""

from __future__ import annotations

from dataclasses import fields

import structlog

from tokendance.backend.api import Prepared, SamplingParams

log = structlog.get_logger("tokendance.requests")
_DEFAULTS = SamplingParams()


def log_request(answer: str, kind: str, p: Prepared, max_len: int | None) -> None:
    """`answer`: the id the client gets (a request of several prompts or choices logs a line
    for each, `request` telling them apart)."""
    r = p.request
    text = "".join(s.text for s in r.segments)
    ids = r.prompt_token_ids if r.prompt_token_ids is not None else p.ids
    params = {f.name: getattr(r.sampling, f.name) for f in fields(SamplingParams)
              if getattr(r.sampling, f.name) != getattr(_DEFAULTS, f.name)}
    log.info("request", id=answer, request=r.id, kind=kind, mode=r.mode, session=r.session, agent=r.agent, round=r.round,
             prompt=text[:max_len] if max_len is not None else text,
             prompt_token_ids=ids[:max_len] if ids is not None and max_len is not None else ids,
             prompt_tokens=p.prompt_tokens, params=params)
