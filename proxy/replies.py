"""Response bodies of the OpenAI API (its model card with vLLM's max_model_len), as msgspec Structs."""

from __future__ import annotations

from msgspec import UNSET, Struct, UnsetType


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprob]


class TextLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """A prompt token's or one of its alternatives' (vLLM's prompt_logprobs)."""

    logprob: float
    rank: int | None  # 1 + how many tokens were likelier
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # None for the first token


class CachedDetails(Struct):
    cached_tokens: int


class ReuseDetails(Struct):
    """What reuse did for one request (an extension; clients that do not know it ignore it)."""

    shared_tokens: int  # prompt tokens inside shared segments
    recomputed_tokens: int  # of the cached ones, recomputed selectively
    kv_dense_bytes: int  # what a dense per-request cache would hold
    kv_held_bytes: int  # what it held privately


class UsageOut(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # known at the end (a streamed chunk's continuous usage has the counts so far only)
    prompt_tokens_details: CachedDetails | None = None
    tokendance: ReuseDetails | None = None


class OutFunction(Struct):
    name: str
    arguments: str  # JSON text


class OutCall(Struct):
    id: str
    function: OutFunction
    type: str = "function"


class OutMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[OutCall] | None = None
    reasoning: str | None = None  # with a reasoning parser (proxy/reasoning.py)
    function_call: OutFunction | None = None  # the deprecated API's (proxy/functions.py)


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class CallDelta(Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatChoice(Struct):
    index: int
    message: OutMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, of the prompt all choices share
    prompt_token_ids: list[int] | None | UnsetType = UNSET  # vLLM's return_token_ids
    prompt_text: str | UnsetType = UNSET  # vLLM's return_prompt_text: the chat as templated


class OutDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[CallDelta] | None = None
    reasoning: str | None = None
    function_call: FunctionDelta | None = None  # the deprecated API's (proxy/functions.py)


class ChunkChoice(Struct):
    index: int
    delta: OutDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids: this chunk's
    stop_reason: str | int | None | UnsetType = UNSET  # vLLM's, in the choice's last chunk


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None
    object: str = "chat.completion.chunk"
    prompt_token_ids: list[int] | None | UnsetType = UNSET  # vLLM's return_token_ids: the first chunk's
    prompt_text: str | UnsetType = UNSET  # vLLM's return_prompt_text: the first chunk's


class TextChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | None = None
    # vLLM's, of this choice's prompt: null in a whole answer without them, not in a chunk
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET
    # vLLM's return_token_ids: its prompt's (streamed: in its first chunk) and its output's
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    stop_reason: str | int | None | UnsetType = UNSET  # vLLM's: in a whole answer, and a choice's last chunk


class Completion(Struct):
    """Both the whole answer and, streamed, each chunk of /v1/completions."""

    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageOut | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    root: str  # vLLM's: the model served under `id` (its own name, whatever --served-model-name says)
    parent: str | None = None
    object: str = "model"
    owned_by: str = "tokendance"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"
