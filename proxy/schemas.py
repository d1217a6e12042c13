"""Request bodies of the OpenAI API, as msgspec Structs, and their checks (the response
bodies are in proxy/replies.py).

Unknown fields are ignored, with a warning in the log naming them (as vLLM does); wrong
types become a 400 naming the field. Features the server knows but does not implement
are rejected by `check_*`, never silently dropped.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import structlog
from msgspec import Struct

from tokendance.backend.api import InvalidRequest, Repetition, SamplingParams, Template
from tokendance.backend.protocol import ModelInfo

from . import tools as t
from .errors import invalid, unsupported
from .structured import ResponseFormat, StructuredOutputs, structure

MAX_N = 64
SAMPLED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # a model may set their defaults
COMPLETION_TOKENS = 16  # a completion's length without max_tokens (OpenAI's legacy API, vLLM)
log = structlog.get_logger("tokendance.proxy")
_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])  # a body's top-level fields, values unread


class TokenDance(Struct, kw_only=True, forbid_unknown_fields=True):
    """The `tokendance` body object (what openai's extra_body sends). Ours, so a field it
    does not know is a 400, not ignored: a misspelt `sesion` would lose the round's reuse."""

    session: str | None = None
    agent: str | None = None
    agents: list[str] | None = None  # a batch of chats: each conversation's agent, in order
    round: int | None = None
    mode: str | None = None
    separators: bool | None = None


class Part(Struct):
    type: str
    text: str | None = None


class Message(Struct, kw_only=True):
    role: str
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[t.MadeCall] | None = None
    tool_call_id: str | None = None
    function_call: t.CalledFunction | None = None  # the deprecated API's (proxy/functions.py)


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the counts so far in every chunk


class RepetitionDetection(Struct, kw_only=True):
    """vLLM's repetition_detection (backend/repetition.py)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's reasoning_effort
EFFORTS = Effort.__args__


class Sampled(Struct, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    # vLLM's extra parameters
    min_p: float | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # reuses only KV computed under the same key and salt
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra parameter
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and k best alternatives
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens it may sample
    logprob_token_ids: list[int] | None = None  # vLLM's: these tokens' logprobs at each step, not the top
    repetition_detection: RepetitionDetection | None = None  # vLLM's: end a loop of tokens early
    thinking_token_budget: int | None = None  # vLLM's: think at most so many tokens (-1: no budget)
    stream_interval: int | None = None  # vLLM's: tokens per streamed chunk (at least the server's)
    bad_words: list[str] | None = None  # vLLM's: words it may not write
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids in the answer
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name their tokens "token_id:N"
    # (None: the server's --return-tokens-as-token-ids)
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last k tokens (-1: the context's)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first k instead
    request_id: str | None = None  # vLLM's: the answer's id, after its prefix
    priority: int = 0  # vLLM's: lower first, under the engine's --scheduling-policy priority
    use_beam_search: bool = False  # vLLM's: n beams (proxy/beams.py)
    length_penalty: float = 1.0  # vLLM's: a beam's score divides its logprob by its length ** this
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra parameter
    user: str | None = None
    tokendance: TokenDance | None = None


class ChatRequest(Sampled, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[t.Tool] | None = None
    tool_choice: str | t.NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[t.Function] | None = None  # deprecated: proxy/functions.py makes them tools
    function_call: str | t.FunctionName | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes the BOS
    # vLLM's: how the chat template renders (backend/api.py Template)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the answer begins with the last message's content, if the assistant's
    reasoning_effort: Effort | None = None  # the template's reasoning_effort (and enable_thinking)
    include_reasoning: bool = True  # vLLM's: false leaves the parsed reasoning (and what reveals it) out
    return_prompt_text: bool = False  # vLLM's: the answer gives the chat as templated, its prompt
    chat_template: str | None = None  # vLLM's: the request's own, where the server trusts them (`own`)


class CompletionRequest(Sampled, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt


class RoundOpen(Struct, kw_only=True):
    """Body of POST .../rounds/{round} and payload of the MQTT open and seal topics."""

    agents: list[str] | None = None
    timeout_ms: float | None = None
    api_key: str | None = None  # over MQTT, under --api-key: whose session (HTTP sends Authorization)


def decode(data: bytes, kind: type[Struct]) -> Any:
    try:
        body = msgspec.json.decode(data, type=kind)
        ignored = sorted(_keys.decode(data).keys() - set(kind.__struct_fields__))
        if ignored:
            log.warning("fields ignored", fields=ignored, body=kind.__name__)
        return body
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = re.search(r"at `\$\.?(.+)`$", text)
        missing = re.search(r"missing required field `([^`]+)`", text)
        # msgspec writes a value in a map as `[...]`: the map's field is the parameter
        param = ".".join(x.group(1).replace("[...]", "") for x in (at, missing) if x) or None
        raise invalid(f"invalid request body: {text}", param, "invalid_type")
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}", None, "invalid_json")
    except RecursionError:
        raise invalid("request body is nested too deeply", None, "invalid_json")


# Checks: everything a client can get wrong, as a 400 before any work is done.

def sampling(body: Sampled, max_tokens: int | None, logprobs: bool, top: int, length: int,
             model: ModelInfo) -> SamplingParams:
    """`length`: the length without max_tokens (a chat's: to the end of the context);
    `model`: its defaults for what the body leaves out, and its --max-logprobs."""
    if not 1 <= body.n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}", "n")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if max_tokens is None:  # the default length (the model's, if shorter), with room for min_tokens
        max_tokens = max(min(length, int(model.sampling.get("max_tokens", length))), body.min_tokens or 0)
    given = {k: v for k in SAMPLED if (v := getattr(body, k)) is not None}
    if given.get("top_k") == -1:  # vLLM's other way to say "off"
        given["top_k"] = 0
    p = SamplingParams(
        **{**model.sampling, **given, "max_tokens": max_tokens}, seed=body.seed, stop=stop,
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens or 0, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        logprobs=logprobs, top_logprobs=top, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias or {}), allowed_token_ids=body.allowed_token_ids,
        bad_words=list(body.bad_words or []),
        structure=structure(body.response_format, body.structured_outputs))
    if (r := body.repetition_detection) is not None:
        p.repetition = Repetition(r.max_pattern_size, r.min_pattern_size, r.min_count)
    p.priority = body.priority
    p.prompt_logprobs = prompt_logprobs(body)
    if body.logprob_token_ids:
        if not logprobs:
            raise invalid("logprob_token_ids needs logprobs set", "logprob_token_ids")
        p.logprob_token_ids = list(dict.fromkeys(body.logprob_token_ids))  # each once, as vLLM lists them
    try:
        p.validate(model.max_logprobs)
    except InvalidRequest as exc:
        chat = isinstance(body, ChatRequest)
        if exc.param == "max_tokens" and chat and body.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"
        if exc.param == "top_logprobs" and not chat:  # a completion's logprobs
            exc.message, exc.param = exc.message.replace("top_logprobs", "logprobs", 1), "logprobs"
        raise invalid(exc.message, exc.param, exc.code)
    return p


def prompt_logprobs(body: Sampled) -> int | None:
    """vLLM's prompt_logprobs as served: never streamed (a chunk has no place for them), so
    k > 0 with `stream` is a 400 and 0 is dropped."""
    if body.prompt_logprobs and body.stream:
        raise invalid("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return None if body.stream else body.prompt_logprobs


def answer_id(request_id: str | None, header: str | None = None) -> str:
    """The answer's id after its prefix: as vLLM takes it, the request's `X-Request-Id`
    header, else its `request_id` (visible ASCII, at most 256 characters: it is a header's
    value too), else a random one."""
    rid, name = (header, "X-Request-Id") if header is not None else (request_id, "request_id")
    if rid is None:
        return secrets.token_hex(12)
    if not (0 < len(rid) <= 256 and all("!" <= c <= "~" for c in rid)):
        raise invalid(f"{name} must be 1 to 256 visible ASCII characters", name)
    return rid


def truncation(k: int | None, max_model_len: int) -> int | None:
    """How many of the prompt's tokens to keep (vLLM's truncate_prompt_tokens `k`; -1: as
    many as the context holds); None: the whole prompt."""
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if not 1 <= k <= max_model_len:
        raise invalid(f"truncate_prompt_tokens must be -1 or between 1 and the context's {max_model_len} "
                      f"tokens, not {k}", "truncate_prompt_tokens")
    return k


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """JSON keys are strings: token ids written in decimal."""
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,18}", key):
            raise invalid(f"logit_bias keys must be token ids, not {key!r}", "logit_bias")
        out[int(key)] = value
    return out


Checked = tuple[list[dict[str, Any]], SamplingParams, t.Tools | None]  # messages, sampling, tools


def check_chat(body: ChatRequest, dialect: Callable[[], str], model: ModelInfo) -> Checked:
    """The messages as the chat template wants them, the sampling parameters and the tools
    (`dialect`: the chat template's, asked only when tools are given). Without a length
    a chat goes on to the end of the context, as in vLLM."""
    tools = t.check(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is not None:
        tools.dialect = dialect()
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    messages = [message(i, m) for i, m in enumerate(body.messages)]
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sp = sampling(body, limit, bool(body.logprobs), body.top_logprobs or 0, model.max_model_len, model)
    forced = tools.structure() if tools is not None else None
    if forced is not None:
        if sp.structure is not None and tools.choice == "auto":
            raise invalid("strict tools hold tool_choice auto's calls to their schemas: "
                          "it takes no response_format or structured_outputs", "tools")
        if sp.structure is not None:
            raise invalid(f"tool_choice {tools.choice} holds the output to the tools' schema: "
                          "it takes no response_format or structured_outputs", "tool_choice")
        sp.structure = forced
    return messages, sp, tools


# apply_chat_template's own arguments, and the names it renders the chat under
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"}


def own(text: str | None, trusted: bool) -> str | None:
    """A request's own chat template, taken only where the server trusts them (vLLM's
    --trust-request-chat-template: a template is code the server runs, in Jinja's sandbox,
    which does not bound its time)."""
    if text is not None and not trusted:
        raise invalid("a request's own chat_template is refused: the server was not started with "
                      "--trust-request-chat-template", "chat_template")
    return text


def template(kwargs: dict[str, Any] | None, add_generation_prompt: bool, continue_final_message: bool,
             effort: str | None = None, chat_template: str | None = None) -> Template | None:
    """How the chat template renders, as vLLM's fields say (None: as it does by default).
    `effort` (vLLM's reasoning_effort) reaches the template as `reasoning_effort`, and
    switches `enable_thinking` (off for "none") unless the kwargs set it; `chat_template`
    (from `own`) replaces the tokenizer's."""
    if add_generation_prompt and continue_final_message:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
    taken = sorted(_RESERVED & set(kwargs or ()))
    if taken:
        raise invalid(f"chat_template_kwargs cannot set {', '.join(taken)}", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    if effort is not None:
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"} | kwargs
    if not kwargs and add_generation_prompt and chat_template is None:
        return None
    return Template(kwargs, add_generation_prompt, continue_final_message, chat_template)


def message(i: int, m: Message) -> dict[str, Any]:
    """A chat message as the template wants it; a 400 naming its field."""
    where = f"messages[{i}]"
    if m.role not in ("system", "developer", "user", "assistant", "tool"):
        raise invalid(f"unknown role {m.role!r}", f"{where}.role")
    if m.tool_calls and m.role != "assistant":
        raise invalid("only assistant messages make tool calls", f"{where}.tool_calls")
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise unsupported(f"{where}.content[{j}]", f"content of type {part.type!r}")
            texts.append(part.text)
        content = "".join(texts)
    elif m.content is None:
        if m.role != "assistant":
            raise invalid("content is required", f"{where}.content")
        content = ""
    else:
        content = m.content
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = t.made_calls(i, m.tool_calls)
    if m.role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def check_completion(body: CompletionRequest, model: ModelInfo) -> tuple[list[str | list[int]], SamplingParams]:
    """The prompts (text or token ids) and the sampling parameters."""
    if body.suffix:
        raise unsupported("suffix")
    if body.best_of not in (None, body.n):
        raise unsupported("best_of", "best_of other than n")
    prompts = _prompts(body.prompt)
    lp = body.logprobs is not None
    length = 1 if body.echo and body.max_tokens == 0 else body.max_tokens  # the prompt alone: one token, dropped
    sp = sampling(body, length, lp, body.logprobs or 0, COMPLETION_TOKENS, model)
    if body.echo and lp:
        sp.prompt_logprobs = max(sp.prompt_logprobs or 0, body.logprobs)
    return prompts, sp


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    def ids(x: list[Any]) -> bool:
        return bool(x) and all(type(t) is int and t >= 0 for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if ids(prompt):
        return [prompt]
    if prompt and all(isinstance(p, list) and ids(p) for p in prompt):
        return list(prompt)
    raise invalid("prompt must be a string, a list of strings, or token ids", "prompt")
