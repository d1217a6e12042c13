"""Incremental detokenization with stop strings.

Text is re-decoded from a window of recent tokens so multi-byte characters split
across tokens come out whole; the tail that could still become a stop string is held
back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_WINDOW = 6  # tokens of left context when decoding the newest ones


@dataclass(slots=True)
class Detok:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    _read: int = 0  # ids[:_read] are reflected in `text`

    def add(self, token: int) -> str | None:
        """Append one token; returns the stop string hit, if any (text cut before it)."""
        self.ids.append(token)
        lo = max(0, self._read - _WINDOW)
        before = self.tokenizer.decode(self.ids[lo:self._read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[lo:], skip_special_tokens=True)
        if now.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            return None
        start = len(self.text)
        self.text += now[len(before):]
        self._read = len(self.ids)
        if not self.stop:
            return None
        longest = max(map(len, self.stop))
        scan = max(0, start - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, scan)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i]
        return s

    def take(self, final: bool) -> str:
        """Text not handed out yet; unless final, keep back what may start a stop string."""
        end = len(self.text)
        if not final and self.stop:
            end = max(self.emitted, end - (max(map(len, self.stop)) - 1))
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
