"""The remote engine's protocol: what `RemoteBackend` (backend/remote.py) and the engine's
endpoint (backend/endpoint.py) send each other over HTTP, as msgspec JSON.

    GET  /v1/engine/info        Info: the model, its limits, its tokenizer's files
    POST /v1/engine/generate    a group: list[Request] -> one Event per line, until every
                                request has finished or failed
    POST /v1/engine/abort       Abort: stop these requests (their events stop coming)
    GET  /v1/engine/gauges      list[Gauge]
    GET  /health                200, or 503 with a WireError: why the engine cannot serve

Requests travel tokenized (prompt_token_ids and shared_spans, made by the proxy with the
engine's own tokenizer files), with their sampling, session and agent.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from tokendance.backend.api import BackendError, Delta, InvalidRequest, Request

PREFIX = "/v1/engine"


class Info(Struct, kw_only=True):
    name: str
    max_model_len: int
    kv_bytes_per_token: int
    vocab_size: int
    tokenizer: dict[str, str]  # file name -> text: what the proxy tokenizes and renders chats with
    sampling: dict[str, int | float] = {}  # the model's default sampling (backend/generation.py)
    priority: bool = False  # it schedules by requests' priority (--scheduling-policy priority)
    eos: list[int] = []  # the tokens that end a sequence unless ignore_eos
    max_logprobs: int = 20  # the alternatives a token may list (its --max-logprobs; -1: any)


class Failure(Struct):
    kind: str  # "invalid": the client's mistake (a 4xx at the proxy); "backend": the engine's
    message: str
    param: str | None = None
    code: str | None = None


class Event(Struct, omit_defaults=True):
    """One line of a group's answer: request `i` of the group has a delta, or failed."""

    i: int
    delta: Delta | None = None
    failure: Failure | None = None


class Abort(Struct):
    ids: list[str]


class WireError(Struct):
    """The body of the endpoint's 4xx / 5xx answers."""

    message: str


encoder = msgspec.json.Encoder()
_groups = msgspec.json.Decoder(list[Request])
_events = msgspec.json.Decoder(Event)


def decode_group(body: bytes) -> list[Request]:
    return _groups.decode(body)


def decode_event(line: bytes) -> Event:
    return _events.decode(line)


def failure(exc: BaseException) -> Failure:
    if isinstance(exc, InvalidRequest):
        return Failure("invalid", exc.message, exc.param, exc.code)
    return Failure("backend", str(exc) or type(exc).__name__)


def raised(f: Failure) -> Exception:
    """The exception a Failure stands for, as the in-process backend would raise it."""
    if f.kind == "invalid":
        return InvalidRequest(f.message, f.param, f.code)
    return BackendError(f.message)


def decode(body: bytes, kind: Any) -> Any:
    return msgspec.json.decode(body, type=kind)

