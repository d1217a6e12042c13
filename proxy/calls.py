"""Reading tool calls out of a choice's text as it streams (proxy/tools.py: the prompt side).

A `Reader` takes the text in pieces and gives back, for each, the content the client may
see and the parts of tool calls it completed. One reader per `tool_choice`:

- `Hermes` (`auto`): content passes through until a `<tool_call>` tag; text that could
  still become one is held back, as is whitespace that may turn out to stand only before
  a call. A body that begins `{"name": ..., "arguments": {` streams its arguments object
  as it comes (as vLLM does), to where it closes; any other body is read whole once its
  closing tag (or the end) comes, and stays content, as the model wrote it, unless it is
  a call (arguments first, or as a JSON text).
- `Llama3` (`auto`, for a template that asks for bare calls, Llama 3.1-3.3's): an answer
  that begins with a `{"name": ..., "parameters": {` object is calls (several joined by
  `;`), their parameters streamed as they come (as vLLM streams them); text after them
  is content. One that begins with `{` otherwise is held back to its end and read whole:
  calls if all of it is call objects, else content. Any other answer streams as it
  comes, as content.
- `Listed` (proxy/listed.py): Granite's and Phi-4-mini's JSON list of calls after a marker.
- `Named`: the whole output is the named function's arguments (held to its schema), so
  they stream as they come.
- `Required`: the output is a JSON list of `{"name", "parameters"}` (held to a schema of
  the tools); its calls are given at the end (cut off by `max_tokens`, those it completed).

Fed the same text in any pieces, a reader gives the same content and calls.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from .scan import Scan, head
from .tools import CLOSE, LLAMA3, MARKERS, OPEN, Tools


@dataclass(slots=True)
class Piece:
    """Part of one tool call of a choice; its first piece has the id and the name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """A choice's content and calls, put together from its pieces."""

    content: str = ""
    calls: list[Piece] = field(default_factory=list)

    def add(self, content: str, pieces: list[Piece]) -> None:
        self.content += content
        for p in pieces:
            if p.index == len(self.calls):
                self.calls.append(Piece(p.index, p.id, p.name, p.arguments))
            else:
                self.calls[p.index].arguments += p.arguments


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class Reader:
    """Base: no tools to read, all of it is content."""

    def __init__(self) -> None:
        self.count = 0  # calls given so far

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        return text, []

    def end(self) -> tuple[str, list[Piece]]:
        return "", []

    def whole(self, text: str) -> Parsed:
        out = Parsed()
        out.add(*self.feed(text))
        out.add(*self.end())
        return out

    def _call(self, name: str, arguments: str) -> Piece:
        self.count += 1
        return Piece(self.count - 1, call_id(), name, arguments)


class Hermes(Reader):
    def __init__(self, parallel: bool = True):
        super().__init__()
        self.parallel = parallel
        self.pending = ""  # held back: a possible tag, whitespace, or the body of an open call
        self.inside = False
        self.gap = ""  # the whitespace before the open call's tag (content again if it fails)
        self.fresh = False  # a call just ended: the whitespace after it is dropped
        self.open: _Open | bool | None = None  # streaming the open call's arguments; False: read whole

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        self.pending += text
        out: list[str] = []
        pieces: list[Piece] = []
        while True:
            if self.inside:
                if self.open is None:
                    self.open = self._start(pieces)
                    if self.open is None:
                        break
                if isinstance(self.open, _Open):
                    if not self._stream(self.open, pieces):
                        break
                    continue
                j = self.pending.find(CLOSE)
                if j < 0:
                    break
                body, self.pending = self.pending[:j], self.pending[j + len(CLOSE):]
                self.inside, self.open = False, None
                out.append(self._read(body, CLOSE, pieces))
                continue
            i = self.pending.find(OPEN)
            if i < 0:
                cut = len(self.pending) - _held(self.pending)
                out.append(self._text(self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            before = self.pending[:i]
            said = before.rstrip()
            out.append(self._text(said))
            self.gap, self.pending, self.inside = before[len(said):], self.pending[i + len(OPEN):], True
        return "".join(out), pieces

    def end(self) -> tuple[str, list[Piece]]:
        rest, self.pending = self.pending, ""
        pieces: list[Piece] = []
        if self.inside:  # a call the end cut off, or one the model never closed
            self.inside, open_ = False, self.open
            self.open = None
            if isinstance(open_, _Open):  # its arguments as far as they came
                self.fresh = True
                return "", pieces
            return self._read(rest, "", pieces), pieces
        return (self._text(rest).rstrip() if self.count else self._text(rest)), pieces

    def _start(self, pieces: list[Piece]) -> _Open | bool | None:
        """A call whose body begins `{"name": ..., "arguments": {` streams its arguments
        from here; any other body is read whole at its end (False); None: too early to say."""
        begun = head(self.pending)
        if not isinstance(begun, tuple):
            return begun
        name, at = begun
        self.gap, self.pending = "", self.pending[at:]
        piece = self._kept(name, "", pieces)
        return _Open(piece.index if piece is not None else None)

    def _stream(self, call: _Open, pieces: list[Piece]) -> bool:
        """Hand on the arguments that came; True once the call has ended (its tag closed)."""
        if not call.scan.done:
            self.pending = self.pending[call.take(self.pending, pieces):]
            if not call.scan.done:
                return False
        j = self.pending.find(CLOSE)  # what lies between (the object's "}") is dropped
        if j < 0:
            return False
        self.pending = self.pending[j + len(CLOSE):]
        self.inside, self.open, self.fresh = False, None, True
        return True

    def _text(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        return text

    def _read(self, body: str, close: str, pieces: list[Piece]) -> str:
        """A call's body: a piece, or the content it stays as when it is not a call."""
        gap, self.gap = self.gap, ""
        call = _hermes_call(body)
        if call is None:
            return self._text(gap + OPEN + body + close)
        self.fresh = True
        self._kept(*call, pieces)
        return ""

    def _kept(self, name: str, arguments: str, pieces: list[Piece]) -> Piece | None:
        """A new call's first piece, added to `pieces`; None for a call past the first
        that parallel_tool_calls false drops."""
        if self.count and not self.parallel:
            return None
        piece = self._call(name, arguments)
        pieces.append(piece)
        return piece


@dataclass(slots=True)
class _Open:
    """A call whose arguments stream; `index` None: a call past the first that
    parallel_tool_calls false drops."""

    index: int | None
    scan: Scan = field(default_factory=Scan)

    def take(self, text: str, pieces: list[Piece]) -> int:
        """Hand on the arguments at the start of `text` (to `pieces`); how many characters
        they are (all of `text` while the arguments object is open)."""
        n = self.scan.feed(text)
        if self.index is not None and n:
            if pieces and pieces[-1].index == self.index:
                pieces[-1].arguments += text[:n]
            else:
                pieces.append(Piece(self.index, arguments=text[:n]))
        return n


def tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text still to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _held(text: str) -> int:
    """How many characters at the end of `text` may still be the start of a call: a
    prefix of the tag, with the whitespace before it."""
    keep = tail(text, OPEN)
    body = text[:len(text) - keep]
    return keep + len(body) - len(body.rstrip())


def _hermes_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return call_of(obj)


def call_of(obj: object) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class Llama3(Reader):
    def __init__(self, parallel: bool = True):
        super().__init__()
        self.parallel = parallel
        self.held = ""  # not given yet: whitespace, a call's beginning, or an answer read whole
        self.passing = False  # the rest is text: it streams
        self.open: _Open | None = None  # the call whose arguments stream
        self.at_end = False  # the rest is read at the end (it began with "{", not as a call streams)

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        if self.passing:
            return text, []
        self.held += text
        pieces: list[Piece] = []
        while not self.at_end:
            if self.open is not None:
                if not self._stream(self.open, pieces):
                    break
                continue
            body = self.held.lstrip(" \t\r\n;" if self.count else " \t\r\n")
            if not body:
                break
            if body[0] != "{":  # text: the answer's, or what follows its calls
                self.passing = True
                out, self.held = (body if self.count else self.held), ""
                return out, pieces
            begun = head(body)
            if begun is None:
                break
            if begun is False:
                self.at_end = True
                break
            name, at = begun
            self.held = body[at:]
            piece = None if self.count and not self.parallel else self._call(name, "")
            if piece is not None:
                pieces.append(piece)
            self.open = _Open(piece.index if piece is not None else None)
        return "", pieces

    def end(self) -> tuple[str, list[Piece]]:
        text, self.held, self.open = self.held, "", None
        if not self.at_end:  # a call cut off keeps the arguments it got
            return ("" if self.count else text), []
        found = _llama3_calls(text) if text.strip() else None
        if found is None:  # text: the answer's, or what follows its calls
            return (text.lstrip(" \t\r\n;").rstrip() if self.count else text), []
        keep = found if self.parallel else found[:max(0, 1 - self.count)]
        return "", [self._call(*c) for c in keep]

    def _stream(self, call: _Open, pieces: list[Piece]) -> bool:
        """Hand on the arguments that came; True once the call's object has closed."""
        if not call.scan.done:
            self.held = self.held[call.take(self.held, pieces):]
            if not call.scan.done:
                return False
        j = self.held.find("}")  # the call object's own brace (what lies before it is dropped)
        if j < 0:
            return False
        self.held, self.open = self.held[j + 1:], None
        return True


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls a whole answer is, None unless all of it is call objects (joined by ';')."""
    dec, at, out = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return out or None
        try:
            obj, at = dec.raw_decode(text, at)
        except ValueError:
            return None
        call = call_of(obj)
        if call is None:
            return None
        out.append(call)


class Named(Reader):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        if self.count == 0:
            return "", [self._call(self.name, text)]
        return "", [Piece(0, arguments=text)] if text else []

    def end(self) -> tuple[str, list[Piece]]:
        return self.feed("") if self.count == 0 else ("", [])


class Required(Reader):
    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, text: str) -> tuple[str, list[Piece]]:
        self.text += text
        return "", []

    def end(self) -> tuple[str, list[Piece]]:
        """The list's calls; cut off by max_tokens, the calls it completed."""
        dec, text = json.JSONDecoder(), self.text
        at = _skip(text, text.find("[") + 1) if "[" in text else 0
        named = []
        while at:
            try:
                c, at = dec.raw_decode(text, at)
                named.append((c["name"], json.dumps(c["parameters"], ensure_ascii=False)))
            except (ValueError, TypeError, KeyError):
                break
            at = _skip(text, at)
        if not named:
            return text, []
        return "", [self._call(*c) for c in named]


def _skip(text: str, at: int) -> int:
    """Past whitespace and commas to the next list item; 0 at the list's end."""
    while at < len(text) and text[at] in " \t\r\n,":
        at += 1
    return 0 if at >= len(text) or text[at] == "]" else at


def reader(tools: Tools | None) -> Reader:
    if tools is None or tools.choice == "none":
        return Reader()
    if tools.choice == "named":
        return Named(tools.name or "")
    if tools.choice == "required":
        return Required()
    if tools.dialect in MARKERS:
        from .listed import Listed  # it builds on this module's Reader
        return Listed(MARKERS[tools.dialect], tools.parallel)
    return Llama3(tools.parallel) if tools.dialect == LLAMA3 else Hermes(tools.parallel)


def finish(r: Reader, reason: str | None) -> str | None:
    """OpenAI's finish_reason: `tool_calls` when the model chose to call (auto, required)
    and stopped by itself; a named function ends `stop`, as OpenAI's does."""
    if reason == "stop" and r.count and not isinstance(r, Named):
        return "tool_calls"
    return reason
