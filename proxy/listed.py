"""Tool calls written as a JSON list after a marker: Granite 3's `<|tool_call|>[{"name":
..., "arguments": {...}}, ...]` (or `<tool_call>[...]`), Phi-4-mini's `functools[...]`
(vLLM's `--tool-call-parser granite` and `phi4_mini_json`).

An answer that begins with a marker (after whitespace) is calls: it is held to its end
and read whole; several lists, each after its marker, are read in turn (a strict tool's
calls come one a list: proxy/tools.py). The text after the last list that reads is
content. An answer that does not begin so streams as content as it comes, and one whose
lists do not read stays content, as the model wrote it.
"""

from __future__ import annotations

import json

from .calls import Piece, Reader, call_of


class Listed(Reader):
    def __init__(self, markers: tuple[str, ...], parallel: bool = True):
        super().__init__()
        self.markers = markers
        self.parallel = parallel
        self.held = ""  # whitespace, a marker's beginning, or calls read at the end
        self.passing = False  # the answer is text: it streams
        self.calls = False  # it began with a marker

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        if self.passing:
            return text, []
        self.held += text
        body = self.held.lstrip()
        if self.calls or not body or any(m.startswith(body) for m in self.markers):
            return "", []
        if any(body.startswith(m) for m in self.markers):
            self.calls = True
            return "", []
        self.passing = True
        out, self.held = self.held, ""
        return out, []

    def end(self) -> tuple[str, list[Piece]]:
        text, self.held = self.held, ""
        found, rest = _lists(text, self.markers) if self.calls else ([], text)
        if not found:
            return text, []
        keep = found if self.parallel else found[:1]
        return rest.strip(), [self._call(*c) for c in keep]


def _lists(text: str, markers: tuple[str, ...]) -> tuple[list[tuple[str, str]], str]:
    """The calls of the lists at the start of `text`, each after a marker (the first's
    required), and what follows the last that reads whole."""
    dec, at, found = json.JSONDecoder(), 0, []
    while True:
        body = text[at:].lstrip()
        mark = next((m for m in markers if body.startswith(m)), None)
        if mark is None:
            return found, text[at:]
        start = len(text) - len(body) + len(mark)
        while start < len(text) and text[start] in " \t\r\n":
            start += 1
        try:
            items, end = dec.raw_decode(text, start)
        except ValueError:
            return found, text[at:]
        calls = [call_of(i) for i in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return found, text[at:]
        found += calls
        at = end
