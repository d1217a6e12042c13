"""A segmented prompt's token ids, and where its shared segments lie among them.

The prompt is tokenized whole, as any engine would tokenize its text, so segmentation
never changes what the model reads. Tokenizing each segment alone would: a byte-level
BPE splits "Ada: I" into "Ada: " + "I" where the whole text has " I", and a SentencePiece
tokenizer (Llama 2, Mistral) puts a "▁" before every segment, a space the text never had.

A shared segment holds the tokens that lie wholly inside its text. A token that straddles
one of its edges (" I" where the segment starts at "I") is private: the tokens inside are
the same wherever the segment stands, which is what makes its KV reusable.
"""

from __future__ import annotations

from typing import Any

from tokendance.backend.api import (TOP_LOGPROBS, BackendError, InvalidRequest, Request, SamplingParams, Segment,
                                    Template)
from tokendance.backend.grammar import Grammars


def request_ids(tokenizer: Any, request: Request) -> tuple[list[int], list[tuple[int, int]]]:
    """A request's prompt ids and its shared segments' spans; only `request.truncate`
    of them if it asks, its prompt's last (or first, truncation side "right") tokens (a
    segment cut short is private then)."""
    if request.prompt_token_ids is not None:
        ids, spans = list(request.prompt_token_ids), list(request.shared_spans)
    else:
        ids, spans = tokenize(tokenizer, request.segments, request.add_special_tokens)
    cut = len(ids) - (request.truncate or len(ids))
    if cut > 0 and request.truncation_side == "right":
        ids, spans = ids[:len(ids) - cut], [(lo, hi) for lo, hi in spans if hi <= len(ids) - cut]
    elif cut > 0:
        ids, spans = ids[cut:], [(lo - cut, hi - cut) for lo, hi in spans if lo >= cut]
    return ids, spans


def fast_tokenizer(path: Any, what: str = "", trust_remote_code: bool = False) -> Any:
    """A fast (Rust) HF tokenizer from a folder, which the prompt's offsets need (with
    `trust_remote_code`, one whose class is code in the folder); BackendError naming
    `what` (or the folder) if it cannot be had."""
    from transformers import AutoTokenizer

    what = what or f"the tokenizer at {path}"
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise BackendError(f"{what} does not load: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise BackendError(f"{what} has no fast (tokenizers) version")
    return tok


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template: Template | None = None) -> str:
    """The chat template applied to `messages` (and `tools`, for a template that renders
    them), with the generation prompt unless `template` says otherwise; a template that
    rejects them is the client's mistake."""
    tp = template or Template()
    own = {} if tp.chat_template is None else {"chat_template": tp.chat_template}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=tp.add_generation_prompt,
                                             continue_final_message=tp.continue_final_message, **own, **tp.kwargs)
    except Exception as e:
        if own:
            raise InvalidRequest(f"the request's chat_template does not render these messages: {e}",
                                 "chat_template") from e
        raise InvalidRequest(f"messages do not fit the model's chat template: {e}", "messages") from e


def check(ids: list[int], sampling: SamplingParams, max_model_len: int, vocab_size: int,
          grammars: Grammars, pooled: bool = False, priority: bool = False, max_logprobs: int = TOP_LOGPROBS
          ) -> None:
    """Raise InvalidRequest unless an engine of these limits can serve this prompt (and
    its structured output's spec compiles). `pooled`: an embedding request, which needs
    no room for a generated token; `priority`: the engine schedules by priority;
    `max_logprobs`: the alternatives a token may list (-1: any)."""
    sampling.validate(max_logprobs)
    sampling.check_priority(priority)
    sampling.check_vocab(vocab_size)
    if sampling.structure is not None:
        grammars.compile(sampling.structure)
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if len(ids) > max_model_len - (not pooled):
        raise InvalidRequest(f"the prompt is {len(ids)} tokens; this model's context is {max_model_len} tokens",
                             "messages", "context_length_exceeded")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"token ids must lie in [0, {vocab_size})", "prompt")


def tokenize(tokenizer: Any, segments: list[Segment], special: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, [start, end) of each shared segment's tokens) by a fast (Rust) HF tokenizer,
    which gives each token's characters; `special` adds the tokens the tokenizer puts
    around a text (a BOS), as vLLM does for completions."""
    text = "".join(s.text for s in segments)
    if not text:
        return [], []
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    spans = []
    i, at = 0, 0
    for s in segments:
        a, b = at, at + len(s.text)
        at = b
        if not s.shared:
            continue
        while i < len(ids) and _first(offsets[i]) < a:
            i += 1
        j = i
        # Tokens an added BOS or EOS stands for have no characters: never inside.
        while j < len(ids) and offsets[j][1] <= b and offsets[j][1] > offsets[j][0]:
            j += 1
        if j > i:
            spans.append((i, j))
        i = j
    return ids, spans


def _first(off: tuple[int, int]) -> int:
    """Where a token starts; one that stands for no characters is before any segment."""
    return off[0] if off[1] > off[0] else -1
