"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; on the
Messages API's routes in Anthropic's: {"type": "error", "error": {"type", "message"}}.

Client mistakes are 4xx with a message naming the parameter; nothing a client sends
may produce a 5xx or a traceback. The middleware turns every exception into that shape.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import structlog
from aiohttp import web

from tokendance.backend.api import BackendError, InvalidRequest, Unavailable
from tokendance.backend.auth import Keys

log = structlog.get_logger("tokendance.proxy")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}


ANTHROPIC = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message, type or TYPES.get(status, "server_error"), param, code)
        self.retry_after = retry_after  # seconds, as the Retry-After header (the openai SDK waits that long)

    def copy(self) -> ApiError:
        """The same answer as an exception of its own (each request of a failed group
        raises one, and may reword its param)."""
        b = self.body
        return ApiError(self.status, b.message, b.param, b.code, b.type, self.retry_after)

    def encode(self) -> bytes:
        return msgspec.json.encode(ErrorEnvelope(self.body))

    def response(self, anthropic: bool = False) -> web.Response:
        body = self.encode() if not anthropic else msgspec.json.encode({"type": "error", "error": {
            "type": ANTHROPIC.get(self.status, "api_error"), "message": self.body.message}})
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.Response(status=self.status, body=body, content_type="application/json", headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def unsupported(param: str, what: str | None = None) -> ApiError:
    return invalid(f"{what or param} is not supported by this server", param, "unsupported")


def from_backend(exc: BaseException) -> ApiError:
    """An engine failure (or an unexpected exception around it) as a 500; an engine that
    could not take the request as a 503, to be sent again once the backend's next poll of
    it may have found it back."""
    if isinstance(exc, InvalidRequest):
        return invalid(exc.message, exc.param, exc.code)
    if isinstance(exc, Unavailable):
        return ApiError(503, f"engine unavailable: {exc}", code="backend_unavailable",
                        retry_after=max(1, math.ceil(exc.retry_after)))  # the header takes whole seconds
    if isinstance(exc, BackendError):
        return ApiError(500, f"engine error: {exc}", code="engine_error", type="server_error")
    return ApiError(500, "internal error", code="internal_error", type="server_error")


@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    anthropic = request.path.startswith("/v1/messages")
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response(anthropic)
    except InvalidRequest as exc:
        return from_backend(exc).response(anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        return ApiError(exc.status, exc.reason, code=code).response(anthropic)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client went away: nothing to answer, nothing to log
        return web.Response(status=499)
    except Exception as exc:
        if not isinstance(exc, BackendError):
            log.exception("unhandled", path=request.path)
        return from_backend(exc).response(anthropic)


GUARDED = ("/v1", "/v2", "/score", "/rerank", "/pooling", "/generative_scoring")


def keys(accepted: frozenset[str]):
    """vLLM's --api-key: a /v1 or /v2 route answers only a request that carries one of
    `accepted` (Authorization: Bearer), else a 401; so do /score, /rerank, /pooling and
    /generative_scoring, which vLLM leaves open (they compute for the caller); the rest
    (health, metrics, tokenize) stays open."""
    wanted = Keys(accepted)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if wanted and request.path.startswith(GUARDED):
            if not wanted.accept(request.headers):
                raise ApiError(401, "an API key this server accepts is required (Authorization: Bearer ...)",
                               code="invalid_api_key")
        return await handler(request)

    return check
