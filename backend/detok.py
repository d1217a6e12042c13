"""Incremental detokenization with stop strings.

Text is re-decoded from a window of recent tokens so multi-byte characters split
across tokens come out whole; the tail that could still become a stop string is held
back until it cannot (unless the stop string is kept in the text, as vLLM's
`include_stop_str_in_output` has it: then whatever comes before the cut is text anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokendance.backend.api import SamplingParams

_WINDOW = 6  # tokens of left context when decoding the newest ones


@dataclass(slots=True)
class Detok:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    keep_stop: bool = False  # the stop string hit stays in the text
    skip_special: bool = True  # special tokens (EOS, a template's markers) leave no text
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    _read: int = 0  # ids[:_read] are reflected in `text`

    @classmethod
    def of(cls, tokenizer: Any, p: SamplingParams) -> Detok:
        return cls(tokenizer, list(p.stop), p.include_stop_str_in_output, p.skip_special_tokens)

    def add(self, token: int, check: bool = True) -> str | None:
        """Append one token; returns the stop string hit, if any (text cut before it, or
        after it when kept). `check` false: no stop string may end the text yet (vLLM's
        min_tokens); one that lies wholly before the next checked token is not looked
        for again."""
        self.ids.append(token)
        lo = max(0, self._read - _WINDOW)
        before = self.tokenizer.decode(self.ids[lo:self._read], skip_special_tokens=self.skip_special)
        now = self.tokenizer.decode(self.ids[lo:], skip_special_tokens=self.skip_special)
        if now.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return None
        start = len(self.text)
        self.text += now[len(before):]
        self._read = len(self.ids)
        if not self.stop or not check:
            return None
        # each stop string ending in the new text (one wholly before it was looked for already)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i + len(s) if self.keep_stop else i]
        return s

    def take(self, final: bool) -> str:
        """Text not handed out yet; unless final, keep back what may start a stop string."""
        end = len(self.text)
        if not final and self.stop and not self.keep_stop:
            end = max(self.emitted, end - (max(map(len, self.stop)) - 1))
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


@dataclass(slots=True)
class Pieces:
    """Each token's text alone, as `tokenizer.decode([id])` gives it, with its UTF-8
    bytes (a logprob's token and bytes), kept once decoded: at most the vocabulary."""

    tokenizer: Any
    known: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    def __call__(self, ids: list[int]) -> list[tuple[str, list[int]]]:
        for i in ids:
            if i not in self.known:
                s = self.tokenizer.decode([i])
                self.known[i] = (s, list(s.encode()))
        return [self.known[i] for i in ids]
