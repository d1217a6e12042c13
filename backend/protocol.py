"""What the proxy asks of an engine: the `Backend` interface (a local engine, a remote
one over HTTP, a fleet, vLLM), the model facts it publishes, its `/metrics` gauges and
the streams `generate` returns. The requests and answers it trades are backend/api.py's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokendance.backend.api import TOP_LOGPROBS, Delta, Prepared, Request, Template


@dataclass(slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    kv_bytes_per_token: int
    # what a request that leaves them out samples with, by SamplingParams' names: the
    # model's generation config (backend/generation.py)
    sampling: dict[str, float] = field(default_factory=dict)
    priority: bool = False  # requests may carry a priority (vLLM's --scheduling-policy priority)
    eos: tuple[int, ...] = ()  # the tokens that end a sequence unless ignore_eos (a beam search's)
    max_logprobs: int = TOP_LOGPROBS  # alternatives a token may list (vLLM's --max-logprobs; -1: any)


@dataclass(slots=True)
class Gauge:
    """One figure of the backend's state for /metrics, as tokendance_engine_<name>."""

    name: str
    help: str
    value: float
    kind: str = "gauge"  # or "counter"
    labels: dict[str, str] = field(default_factory=dict)  # e.g. which engine of a fleet


class Stream(Protocol):
    def __aiter__(self) -> AsyncIterator[Delta]: ...

    def abort(self) -> None: ...


class Backend(Protocol):
    info: ModelInfo
    tokenizer: Any  # the HF tokenizer its prompts are tokenized with; None without a model

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, where the template renders
        them), with the generation prompt unless `template` says otherwise."""

    def prepare(self, request: Request) -> Prepared:
        """Tokenize and validate; raises InvalidRequest for client mistakes."""

    def generate(self, group: list[Prepared]) -> list[Stream]:
        """Start every request of one barrier group together; one stream each."""

    def gauges(self) -> list[Gauge]:
        """The backend's state for /metrics (KV pool, host tier, queues); may be empty."""

    def problem(self) -> str | None:
        """Why the backend cannot serve now, for /health (a 503); None when it can."""

    async def close(self) -> None: ...
