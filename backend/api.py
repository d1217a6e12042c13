"""The boundary between the proxy and an engine.

The proxy turns an HTTP request into a `Request` (a list of segments plus sampling
parameters), asks the backend to `prepare` it (tokenize, validate) before the round
barrier, and hands the whole barrier group to `generate` in one call. Each request
then streams `Delta`s until one carries a `finish_reason`. This file holds what they
trade; the interface itself (`Backend`, `Stream`, `ModelInfo`) is backend/protocol.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MODES = ("full", "prefix", "pic", "collective", "kvcomm", "kvcmas")
REUSING = ("pic", "collective", "kvcomm", "kvcmas")  # the modes that reuse shared segments
# The modes that read a segment as base + an offset predicted from anchors, each request
# with a dense cache (backend/kvcomm.py): KVCOMM's, and KVCMAS's (low-rank anchors over
# its producer's KV as the base).
ANCHORED = ("kvcomm", "kvcmas")
# pic / collective: a shared segment's base KV, prefilled standalone once per round; the
# KV its producer computed as its output (producer chaining: no prefill; on SmolLM2 it
# kept fewer debates identical to exact prefill); or the KV of it in a reader's context
# (two requests of the group prefilled in full; docs/fidelity.md).
BASES = ("standalone", "producer", "reader")
POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy (backend/scheduler.py)
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype (kernels/fp8.py)
# vLLM's --quantization: fp8 rounds a wide checkpoint or names an fp8 one, compressed-tensors
# names one of llm-compressor's (backend/quant.py)
QUANTIZATIONS = ("fp8", "compressed-tensors")
# The reuse policy's defaults (EngineConfig, `serve` and `simulate`, the benchmarks): at
# most 15 % of each request's reused tokens recomputed, no deviation floor, standalone bases,
# shared segments reused from the length the device gains by (None: the engine's default).
REUSE_DEFAULTS: dict[str, Any] = {"recompute_ratio": 0.15, "recompute_floor": 0.0, "bases": "standalone",
                                  "min_shared_tokens": None}
TOP_LOGPROBS = 20  # alternatives a token's logprob lists at most, by default (vLLM's --max-logprobs)
LABELS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS: label tokens a request may read at most


class InvalidRequest(ValueError):
    """A client mistake: the proxy answers it with a 4xx, naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_mode(mode: str, param: str = "mode") -> None:
    if mode not in MODES:
        raise InvalidRequest(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}", param)


class BackendError(RuntimeError):
    """The engine failed; every request of the affected group gets this error."""


class Unavailable(BackendError):
    """The engine could not be reached, or said it cannot serve now: nothing of the
    request ran there, so it may be sent again (a 503 at the proxy), best once the
    backend has looked at the engine again, `retry_after` seconds on."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Lost(BackendError):
    """The engine was lost while it ran the request (its connection broke, it ended the
    answer early): what it generated is gone with it. A fleet sends a request that has
    shown its client nothing to another engine, from the start."""


@dataclass(slots=True)
class Structure:
    """What the output must match (backend/grammar.py): a JSON schema (`spec` its JSON
    text), any JSON object, a regular expression, one of a JSON list of strings, an EBNF
    grammar, or an xgrammar structural tag (its JSON text: free text whose tagged parts,
    tool calls for one, are held to formats of their own)."""

    kind: str  # "json" | "json_object" | "regex" | "choice" | "grammar" | "structural_tag"
    spec: str = ""
    param: str = "response_format"  # the request's field it came from, for errors
    whitespace: bool = True  # JSON may hold any whitespace between its tokens (vLLM's default)
    # The output is free up to this text's tokens and held from there on (a reasoning
    # model's "</think>", as vLLM lets the model think first); "": from its first token.
    after: str = ""


@dataclass(slots=True)
class Template:
    """How a chat is rendered, as vLLM's chat requests say it: variables for the template
    (Qwen3's `enable_thinking`, say), the generation prompt, the last (assistant)
    message left open for the model to go on with, or the request's own template (vLLM's,
    where the server trusts them) instead of the tokenizer's."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None


@dataclass(slots=True)
class Repetition:
    """vLLM's repetition_detection (backend/repetition.py): end once the output ends in a
    pattern of min_pattern_size (0: 1) to max_pattern_size tokens, min_count times in a row."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def validate(self) -> None:
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise InvalidRequest("repetition_detection needs 0 <= min_pattern_size <= max_pattern_size "
                                 "(both 0: off)", "repetition_detection")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise InvalidRequest("repetition_detection's min_count must be at least 2", "repetition_detection")


@dataclass(slots=True)
class ThinkBudget:
    """vLLM's thinking_token_budget (backend/thinking.py): at most `tokens` inside a think
    block, which the token ids `start` open and `end` close."""

    tokens: int
    start: list[int]
    end: list[int]

    def validate(self) -> None:
        if self.tokens < 0:
            raise InvalidRequest("thinking_token_budget must be at least 0 (-1: no budget)", "thinking_token_budget")
        if not self.start or not self.end:
            raise InvalidRequest("a thinking budget needs the tokens that open and close a think block",
                                 "thinking_token_budget")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p times the likeliest are dropped
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: no end (EOS, stop_token_ids, a stop string) before this many tokens; a stop
    # string kept in the text; special tokens (EOS, a template's markers) written out
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's logprob_token_ids: with logprobs, these tokens' logprobs are listed at every
    # step in place of the top_logprobs best (an LLM judge's labels, read in one step)
    logprob_token_ids: list[int] | None = None
    # each prompt token's logprob given those before it, with this many alternatives
    # (backend/scoring.py; the request then runs in `full`): None for none
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far, vLLM's over prompt and output
    # too, and OpenAI's bias by token id (backend/penalties.py applies them).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's: the only tokens it may sample (None: all); words it may not write (backend/banned.py)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    structure: Structure | None = None  # structured outputs (backend/grammar.py)
    repetition: Repetition | None = None  # vLLM's repetition_detection (backend/repetition.py)
    think_budget: ThinkBudget | None = None  # vLLM's thinking_token_budget (backend/thinking.py)
    # vLLM's priority, under --scheduling-policy priority: lower values are served first
    priority: int = 0

    def check_priority(self, ranked: bool) -> None:
        """InvalidRequest for a priority other than 0 where the backend is not `ranked`
        (scheduling by priority), as vLLM refuses one."""
        if self.priority and not ranked:
            raise InvalidRequest(f"priority {self.priority}: this engine serves first come, first served "
                                 "(start it with --scheduling-policy priority)", "priority", "unsupported")

    def validate(self, max_logprobs: int = TOP_LOGPROBS) -> None:
        """InvalidRequest for a value out of its range; `max_logprobs`: the server's (-1: any)."""
        if self.max_tokens <= 0:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest("temperature must be between 0 and 2", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise InvalidRequest("top_k must be 0 (off) or positive", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p must be between 0 and 1", "min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be between 0 and max_tokens ({self.max_tokens})", "min_tokens")
        top, bound = ((max_logprobs, f"between 0 and {max_logprobs} (the server's --max-logprobs)")
                      if max_logprobs >= 0 else (math.inf, "at least 0"))
        for name, k in (("top_logprobs", self.top_logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not 0 <= k <= top:
                raise InvalidRequest(f"{name} must be {bound}", name)
        if self.logprob_token_ids is not None and not 1 <= len(self.logprob_token_ids) <= LABELS:
            raise InvalidRequest(f"logprob_token_ids must name between 1 and {LABELS} tokens", "logprob_token_ids")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:  # torch's; n > 1 adds up to 63
            raise InvalidRequest("seed must be a 64-bit signed integer", "seed")
        if not -2**63 <= self.priority < 2**63:
            raise InvalidRequest("priority must be a 64-bit signed integer", "priority")
        if len(self.stop) > 16:
            raise InvalidRequest("at most 16 stop sequences", "stop")
        if not all(self.stop):  # "" would stop before the first token
            raise InvalidRequest("stop sequences must be non-empty strings", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be between -2 and 2", name)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequest("repetition_penalty must be a positive number", "repetition_penalty")
        for token, bias in self.logit_bias.items():
            if type(token) is not int or token < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids, not {token!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias of token {token} is {bias}; it must be between -100 "
                                     "and 100", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must name at least one token", "allowed_token_ids")
        if not all(self.bad_words):
            raise InvalidRequest("bad_words must be non-empty strings", "bad_words")
        for part in (self.repetition, self.think_budget):
            if part is not None:
                part.validate()

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequest for a logit_bias, allowed or label token id outside the
        vocabulary, or for more alternatives than it holds."""
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > vocab_size:
                raise InvalidRequest(f"{name} must be at most the vocabulary's {vocab_size}", name)
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logprob_token_ids", self.logprob_token_ids or [])):
            outside = sorted(t for t in ids if not 0 <= t < vocab_size)
            if outside:
                raise InvalidRequest(f"{name} names token ids outside the vocabulary [0, {vocab_size}): "
                                     f"{', '.join(map(str, outside[:5]))}", name)

    @property
    def penalized(self) -> bool:
        """Whether sampling changes the logits before choosing (penalties, a bias, banned tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        # Below vLLM's 1e-5, logits / temperature overflows float32: the argmax is the answer.
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(slots=True)
class Pooling:
    """An embedding request: the prompt's last token's final hidden state is its answer,
    as vLLM pools a generative model converted to embeddings (backend/pooling.py);
    nothing is generated."""

    normalize: bool = True  # to unit length (vLLM's default)


@dataclass(slots=True)
class Segment:
    """A piece of the prompt. The prompt is tokenized whole; a shared segment holds the
    tokens wholly inside its text (backend/prompt.py), whose reusable KV is keyed by them."""

    text: str
    shared: bool = False
    # Who produced this text (session, agent, round), when the proxy knows it:
    # the producer's own KV of it is the preferred base for reuse.
    producer: tuple[str, str, int] | None = None


@dataclass(slots=True)
class Request:
    id: str
    segments: list[Segment]
    sampling: SamplingParams
    mode: str | None = None  # one of MODES; None: the server's default
    session: str | None = None
    agent: str | None = None
    round: int | None = None
    prompt_token_ids: list[int] | None = None  # set instead of segments for token prompts
    # With prompt_token_ids: [start, end) of each shared segment's tokens (a remote proxy
    # tokenized the segments with the engine's tokenizer and sends the result).
    shared_spans: list[tuple[int, int]] = field(default_factory=list)
    tenant: str = ""  # namespaces the segment cache (the API key)
    add_special_tokens: bool = False  # the tokenizer's BOS/EOS around the text (vLLM: completions)
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: only this many of the prompt's tokens
    truncation_side: str = "left"  # which end `truncate` cuts: "left" keeps the last tokens, "right" the first
    pooling: Pooling | None = None  # an embedding: the prompt pooled, nothing generated
    # Outside a session: requests of one route go to one engine of a fleet while it serves
    # (a beam search's steps, whose prompts grow from one another: its prefix cache has them)
    route: str | None = None
    # Its client reads the answer whole, not streamed: a fleet holds its deltas until the
    # end, so that a request whose engine is lost partway can start again on another
    whole: bool = False


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed
    recomputed_tokens: int = 0  # reused tokens that were recomputed selectively
    shared_tokens: int = 0  # prompt tokens inside shared segments
    kv_dense_bytes: int = 0  # what a dense per-request cache would hold
    kv_held_bytes: int = 0  # what this request holds privately
    # Pool blocks it read without holding them (a Mirror's Master, prefix-cache hits) and
    # one block's bytes: a round counts each such block once, however many read it.
    shared_blocks: tuple[int, ...] = ()
    block_bytes: int = 0


@dataclass(slots=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]
    id: int | None = None  # the token's id (None from a backend that does not name it)


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    bytes: list[int]
    top: list[TopLogprob] = field(default_factory=list)
    id: int | None = None  # the token's id (None from a backend that does not name it)
    rank: int | None = None  # a scored prompt token's (backend/scoring.py): 1 + how many were likelier


@dataclass(slots=True)
class Delta:
    """New output of one request since its previous delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "repetition"
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    usage: Usage | None = None  # set on the last delta
    # on a request's first delta, with SamplingParams.prompt_logprobs: one per prompt token
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # a pooling request's, on its last (only) delta
    # When it came from its engine (time.perf_counter), where it was held before it was
    # shown (a fleet's request read whole): what time-to-first-token counts from
    at: float | None = None


@dataclass(slots=True)
class Prepared:
    """A request the backend accepted: tokenized and within limits."""

    request: Request
    prompt_tokens: int
    state: Any = None  # the backend's own data (token ids per segment, ...)
    ids: list[int] | None = None  # the prompt's token ids (None: a backend without a tokenizer)
