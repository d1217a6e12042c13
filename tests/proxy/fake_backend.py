"""A deterministic Backend for the proxy tests.

Tokens are whitespace-separated words. The reply echoes the last `length` words of the
prompt's last message (rotated by the seed when sampling), so it is predictable and
differs between agents. Shared segments are "reused" when an earlier request of the same
tenant (or an earlier one in the same group) held the same text: that is cached_tokens.
It can be made slow (`delay` per token) or failing (`fail` = "generate" | "stream").
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import AsyncIterator
from typing import Any

from tokendance.backend.api import (BackendError, Delta, InvalidRequest, Prepared, Request, TokenLogprob,
                                    TopLogprob, Usage)
from tokendance.backend.protocol import Gauge, ModelInfo

WORD = re.compile(r"\S+\s*|\s+")
TEMPLATE = re.compile(r"<\|im_(start|end)\|>(system|user|assistant)?")


def words(text: str) -> list[str]:
    return WORD.findall(text)


class FakeBackend:
    tokenizer = None  # words, not a tokenizer: /tokenize answers 501
    def __init__(self, name: str = "fake-tiny", max_model_len: int = 4096, length: int = 6,
                 delay: float = 0.0, fail: str | None = None, kv_bytes: int = 1024):
        self.info = ModelInfo(name, max_model_len, kv_bytes)
        self.length, self.delay, self.fail = length, delay, fail
        self.groups: list[list[Request]] = []  # one list per generate() call
        self.active: set[str] = set()  # requests holding KV
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.cache: set[tuple[str, str]] = set()
        self.closed = False
        self.down: str | None = None  # what problem() reports

    def last_prompt(self) -> str:
        """The prompt of the first request of the last group it was given, as text."""
        return "".join(s.text for s in self.groups[-1][0].segments)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Any = None) -> str:
        out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(out) + ("<|im_start|>assistant\n" if template is None or template.add_generation_prompt else "")

    def prepare(self, request: Request) -> Prepared:
        if request.prompt_token_ids is not None:
            text = " ".join(f"t{i}" for i in request.prompt_token_ids)
        else:
            text = "".join(s.text for s in request.segments)
        n = len(words(text))
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if n >= self.info.max_model_len:
            raise InvalidRequest(f"the prompt has {n} tokens; the context holds "
                                 f"{self.info.max_model_len}", "messages", "context_length_exceeded")
        request.sampling.validate()
        request.sampling.check_priority(self.info.priority)
        return Prepared(request, n, state=text)

    def generate(self, group: list[Prepared]) -> list[FakeStream]:
        self.groups.append([p.request for p in group])
        if self.fail == "generate":
            raise BackendError("fake engine failure")
        streams = []
        for p in group:
            r = p.request
            shared = cached = 0
            for s in r.segments:
                if s.shared:
                    k = len(words(s.text))
                    shared += k
                    if (r.tenant, s.text) in self.cache:
                        cached += k
                    self.cache.add((r.tenant, s.text))
            kv = self.info.kv_bytes_per_token
            usage = Usage(p.prompt_tokens, 0, cached, 0, shared, p.prompt_tokens * kv,
                          (p.prompt_tokens - cached) * kv)
            self.active.add(r.id)
            streams.append(FakeStream(self, p, self.reply(p), usage))
        return streams

    def reply(self, p: Prepared) -> list[str]:
        body = p.state.rsplit("<|im_start|>assistant", 1)[0]
        body = body.rsplit("<|im_start|>", 1)[-1].split("\n", 1)[-1]  # the last message, no role
        ws = TEMPLATE.sub(" ", body).split()[-self.length:] or ["empty"]
        sp = p.request.sampling
        if not sp.greedy and sp.seed is not None:
            k = sp.seed % len(ws)
            ws = ws[k:] + ws[:k]
        return [w + " " for w in ws[:-1]] + [ws[-1]]

    def gauges(self) -> list[Gauge]:
        return [Gauge("groups", "groups generated", len(self.groups))]

    def problem(self) -> str | None:
        return self.down

    async def close(self) -> None:
        self.closed = True


class FakeStream:
    def __init__(self, backend: FakeBackend, p: Prepared, tokens: list[str], usage: Usage):
        self.backend, self.p, self.tokens, self.usage = backend, p, tokens, usage
        self.aborted = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        b, rid, sp = self.backend, self.p.request.id, self.p.request.sampling
        limit = min(sp.max_tokens, len(self.tokens))
        text = ""
        for i, tok in enumerate(self.tokens[:limit]):
            if b.delay:
                await asyncio.sleep(b.delay)
            if self.aborted:
                return
            if b.fail == "stream" and i == 1:
                b.active.discard(rid)
                raise BackendError("fake failure mid-stream")
            finish = None
            full = text + tok
            hits = [full.find(s) for s in sp.stop if s in full]
            if hits:
                tok, finish = full[:min(hits)][len(text):], "stop"
            elif i == limit - 1:
                finish = "length" if limit < len(self.tokens) else "stop"
            text += tok
            d = Delta(tok, [zlib.crc32(tok.encode()) % 50_000], self._logprobs(tok), finish)
            if finish:
                self.usage.completion_tokens = i + 1
                d.usage = self.usage
                b.active.discard(rid)
                b.finished.add(rid)
            yield d
            if finish:
                return

    def _logprobs(self, tok: str) -> list[TokenLogprob]:
        sp = self.p.request.sampling
        if not sp.logprobs:
            return []
        top = [TopLogprob(tok, -0.5, list(tok.encode()))]
        top += [TopLogprob(f"alt{k}", -1.0 - k, list(f"alt{k}".encode())) for k in range(1, sp.top_logprobs)]
        return [TokenLogprob(tok, -0.5, list(tok.encode()), top[: sp.top_logprobs])]

    def abort(self) -> None:
        self.aborted = True
        self.backend.aborted.add(self.p.request.id)
        self.backend.active.discard(self.p.request.id)
