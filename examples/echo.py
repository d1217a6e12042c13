"""A model-free Backend: words for tokens, deterministic replies, reuse by segment hash.

It lets the proxy, the adapters and `tokendance simulate --model echo` run in
milliseconds: replies are a hash of the prompt, so two runs of one seed agree, and
its usage reports what a collective engine would reuse (every shared segment already
seen by this backend, in an earlier group or earlier in the same group). Nothing here
is a language model; it checks wiring, not quality.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from tokendance.backend.api import (ANCHORED, REUSING, Delta, InvalidRequest, Prepared, Request, Template,
                                    Usage, check_mode)
from tokendance.backend.protocol import ModelInfo, Stream

WORDS = (
    "yes", "no", "maybe", "the", "answer", "is", "five", "cents", "minutes", "bridge",
    "market", "rain", "agree", "because", "I", "think", "we", "should", "wait", "go",
)
BYTES_PER_TOKEN = 1024


class EchoStream:
    def __init__(self, words: list[str], finish: str, usage: Usage):
        self.words, self.finish, self.usage = words, finish, usage
        self.aborted = False

    async def __aiter__(self) -> AsyncIterator[Delta]:
        for i, w in enumerate(self.words):
            await asyncio.sleep(0)
            if self.aborted:
                yield Delta(finish_reason="abort", usage=self.usage)
                return
            last = i == len(self.words) - 1
            yield Delta(text=(" " if i else "") + w, token_ids=[WORDS.index(w)],
                        finish_reason=self.finish if last else None, usage=self.usage if last else None)

    def abort(self) -> None:
        self.aborted = True


class EchoBackend:
    """Implements tokendance.backend.protocol.Backend without a model."""

    tokenizer = None

    def __init__(self, mode: str = "collective", max_model_len: int = 32768):
        check_mode(mode)
        self.mode = mode
        self.info = ModelInfo("echo", max_model_len, BYTES_PER_TOKEN)
        self.seen: set[bytes] = set()  # hashes of shared segments whose "KV" exists

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        turns = [f"<|{m.get('role', 'user')}|>\n{m.get('content') or ''}\n" for m in messages]
        return "".join(turns) + ("<|assistant|>\n" if template is None or template.add_generation_prompt else "")

    def prepare(self, request: Request) -> Prepared:
        mode = request.mode or self.mode
        check_mode(mode)
        if request.pooling is not None:
            raise InvalidRequest("the echo backend has no model to compute embeddings with", "model")
        request.sampling.validate()
        if request.prompt_token_ids is not None:
            n = len(request.prompt_token_ids)
        else:
            n = sum(len(s.text.split()) for s in request.segments)
        if n >= self.info.max_model_len:
            raise InvalidRequest(f"prompt of {n} tokens exceeds {self.info.max_model_len}", "messages")
        return Prepared(request, n, mode)

    def generate(self, group: list[Prepared]) -> list[Stream]:
        return [self._one(p) for p in group]

    def _one(self, p: Prepared) -> EchoStream:
        req: Request = p.request
        shared = reused = 0
        for seg in req.segments if req.prompt_token_ids is None else []:
            if not seg.shared:
                continue
            n = len(seg.text.split())
            shared += n
            key = hashlib.sha256(seg.text.encode()).digest()
            if p.state in REUSING and key in self.seen:
                reused += n
            self.seen.add(key)
        prompt = "".join(s.text for s in req.segments) + str(req.prompt_token_ids or "")
        words = reply(prompt, req.sampling.seed, req.sampling.max_tokens)
        usage = Usage(
            prompt_tokens=p.prompt_tokens, completion_tokens=len(words), cached_tokens=reused,
            shared_tokens=shared, kv_dense_bytes=p.prompt_tokens * BYTES_PER_TOKEN,
            kv_held_bytes=(p.prompt_tokens - (reused if p.state not in ANCHORED else 0)) * BYTES_PER_TOKEN,
        )
        finish = "length" if len(words) == req.sampling.max_tokens else "stop"
        return EchoStream(words, finish, usage)

    def gauges(self) -> list:
        return []

    def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        self.seen.clear()


def reply(prompt: str, seed: int | None, max_tokens: int) -> list[str]:
    """A deterministic reply of at most `max_tokens` words (8 to 15: long enough for
    the proxy to find it again in later prompts)."""
    h = hashlib.sha256(f"{seed}|{prompt}".encode()).digest()
    n = min(max_tokens, 8 + h[0] % 8)
    return [WORDS[b % len(WORDS)] for b in h[1:1 + n]]
