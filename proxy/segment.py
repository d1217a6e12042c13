"""Segmentation: a prompt becomes a list of private and shared segments.

Two sources of shared segments (docs/proxy.md has the user-facing rules):

- explicit: with separators switched on for a request, each message's content is split
  at SEP; every block with a separator on both sides is shared, the text before the
  first and after the last separator is private. `escape(SEP)` writes a literal SEP.
- automatic: outputs the proxy produced earlier in the session are found, as exact
  strings, inside the private text of the rendered prompt.

Without separators switched on, content is taken literally: a SEP inside it is text.

The wire form for backends that need a flat prompt (`flatten`) wraps every shared
segment in SEP on both sides and escapes all text, so no text can create or hide a
boundary. Escaping inserts "~" after every "<|td": the result never contains SEP, and
`unescape` inverts it exactly.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
from collections.abc import Callable
from typing import Any

from tokendance.backend.api import Segment

from .known import Known, Producer

SEP = "<|td-sep|>"
_HEAD, _ESC = "<|td", "<|td~"


def escape(text: str) -> str:
    return text.replace(_HEAD, _ESC)


def unescape(text: str) -> str:
    return text.replace(_ESC, _HEAD)


def blocks(content: str) -> list[tuple[str, bool]]:
    """Explicit grammar of one message's content: (text, shared) pairs, empty ones dropped."""
    parts = content.split(SEP)
    last = len(parts) - 1
    return [(unescape(p), 0 < i < last) for i, p in enumerate(parts) if p]


def flatten(segments: list[Segment]) -> str:
    return "".join(SEP + escape(s.text) + SEP if s.shared else escape(s.text) for s in segments)


def unflatten(text: str) -> list[Segment]:
    return [Segment(unescape(p), shared=i % 2 == 1) for i, p in enumerate(text.split(SEP)) if p]


def chat(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]],
         explicit: bool, known: Known) -> list[Segment]:
    """Render the chat template and segment the result."""
    if not explicit:
        return detect([Segment(render(messages))], known)
    # Wrap explicit shared blocks in a one-time mark no message can contain, render,
    # then cut the rendered text at the marks: the template may add text around
    # content but never inside it.
    mark = _mark([m["content"] for m in messages])
    marked, count = [], 0
    for m in messages:
        out = []
        for text, shared in blocks(m["content"]):
            out.append(mark + text + mark if shared else text)
            count += shared
        marked.append({**m, "content": "".join(out)})
    parts = render(marked).split(mark)
    if len(parts) != 2 * count + 1:  # the template dropped or repeated content
        plain = [{**m, "content": "".join(t for t, _ in blocks(m["content"]))} for m in messages]
        return detect([Segment(render(plain))], known)
    segs = [Segment(p, shared=i % 2 == 1) for i, p in enumerate(parts) if p]
    return detect(segs, known)


def text(prompt: str, explicit: bool, known: Known) -> list[Segment]:
    """Segment a raw completion prompt (the explicit grammar applies to all of it)."""
    segs = [Segment(t, shared=s) for t, s in blocks(prompt)] if explicit else [Segment(prompt)]
    return detect(segs, known)


def detect(segs: list[Segment], known: Known) -> list[Segment]:
    """Mark exact occurrences of known outputs inside private segments as shared."""
    for s in segs:
        if s.shared:
            s.producer = known.get(s.text.strip())
    # One search through all the private text (with separators on, a prompt has a private
    # segment per stretch of template text): matches that cross a segment's end are dropped.
    texts = [s.text for s in segs if not s.shared]
    ends = list(itertools.accumulate(map(len, texts)))
    matches = iter(_matches("".join(texts), ends, known) if known else ())
    m = next(matches, None)
    out: list[Segment] = []
    start = 0  # of the current private segment in the joined text
    for s in segs:
        if s.shared:
            out.append(s)
            continue
        pos, end = 0, start + len(s.text)
        while m is not None and m[0] < end:
            a, b = m[0] - start, m[1] - start
            if a > pos:
                _private(out, s.text[pos:a])
            out.append(Segment(s.text[a:b], shared=True, producer=m[2]))
            pos = b
            m = next(matches, None)
        if pos < len(s.text):
            _private(out, s.text[pos:])
        start = end
    return out


def _private(out: list[Segment], text: str) -> None:
    if out and not out[-1].shared:
        out[-1].text += text
    else:
        out.append(Segment(text))


def _matches(text: str, ends: list[int], known: Known) -> list[tuple[int, int, Producer]]:
    """Non-overlapping occurrences in `text`, none crossing an end of segment (`ends`), by start."""
    found = []
    for s, producer in known.candidates(text).items():
        i = text.find(s)
        while i >= 0:
            end = ends[bisect.bisect_right(ends, i)]  # of the segment holding i
            if i + len(s) <= end:
                found.append((i, i + len(s), producer))
                i = text.find(s, i + len(s))
            else:  # an occurrence starting before `end` would cross it too
                i = text.find(s, end)
    # Longest first, then leftmost; a match that overlaps one already taken is dropped.
    found.sort(key=lambda m: (m[0] - m[1], m[0]))
    used = bytearray(len(text))
    taken = []
    for a, b, producer in found:
        if used.find(1, a, b) < 0:
            used[a:b] = b"\x01" * (b - a)
            taken.append((a, b, producer))
    taken.sort(key=lambda m: m[0])
    return taken


def _mark(texts: list[str]) -> str:
    while True:
        mark = f"\ue000{secrets.token_hex(6)}\ue001"
        if not any(mark in t for t in texts):
            return mark
