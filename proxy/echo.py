"""The legacy completions' `echo`: each choice's text begins with its prompt and, with
`logprobs`, its logprobs with the prompt tokens' (the engine scores them:
backend/scoring.py; the first token's is null). With `max_tokens` 0 a choice is its
prompt alone, scored: the engine generates one token, which the answer leaves out.

vLLM's chat `echo` is the same for the last message's content, when that is the
assistant's (what `continue_final_message` goes on from): each choice's content begins
with it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tokendance.backend.api import Delta, TokenLogprob

from .errors import unsupported


@dataclass(slots=True)
class Echo:
    texts: list[str]  # each choice's prompt, as its text begins
    only: bool  # max_tokens 0: the prompt alone
    top: int  # alternatives per token (`logprobs`; the engine may have scored more)
    begun: list[bool] = field(default_factory=list)  # streamed: the prompt was sent

    def text(self, i: int, said: str) -> str:
        return self.texts[i] + ("" if self.only else said)

    def logprobs(self, scored: list[TokenLogprob], said: list[TokenLogprob]) -> list[TokenLogprob]:
        """A choice's logprobs: its prompt's (`scored`), then what it said."""
        return self._cut(scored) + ([] if self.only else said)

    def piece(self, i: int, d: Delta, scored: list[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """What a streamed chunk of choice i carries for delta d: the prompt first."""
        text, lps = ("", []) if self.only else (d.text, d.logprobs)
        if self.begun[i]:
            return text, lps
        self.begun[i] = True
        return self.texts[i] + text, self._cut(scored) + lps

    def _cut(self, scored: list[TokenLogprob]) -> list[TokenLogprob]:
        return [t if len(t.top) <= self.top else replace(t, top=t.top[:self.top]) for t in scored]


def make(prompts: list[str | list[int]], n: int, only: bool, top: int, tokenizer: Any) -> Echo:
    """An Echo of each prompt's `n` choices (a token prompt decoded by `tokenizer`)."""
    texts = []
    for p in prompts:
        if isinstance(p, list):
            if tokenizer is None:
                raise unsupported("echo", "echo of token ids (this backend gives the proxy no tokenizer)")
            p = tokenizer.decode(p)
        texts += [p] * n
    return Echo(texts, only, top, [False] * len(texts))
