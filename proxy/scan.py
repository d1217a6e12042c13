"""Scanning JSON text as it streams, for the tool-call readers (proxy/calls.py): where a
value closes, and whether a call's body has begun as one that can stream."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True)
class Scan:
    """Where a JSON value's text (an object, a list or a string), coming in pieces, closes."""

    depth: int = 0
    string: bool = False
    escape: bool = False
    done: bool = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value: all of them while it is open."""
        for i, c in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


# "": the name, a JSON string; a tuple: either key (Hermes writes "arguments", Llama 3 "parameters")
_HEAD = ("{", '"name"', ":", "", ",", ('"arguments"', '"parameters"'), ":", "{")


def head(body: str) -> tuple[str, int] | bool | None:
    """(name, where the arguments object starts) when `body` begins as a call written name
    first, arguments (or parameters) an object; False when it cannot; None while it still may."""
    at, name = 0, ""
    for part in _HEAD:
        while at < len(body) and body[at] in " \t\r\n":
            at += 1
        if at == len(body):
            return None
        if not part:  # the name
            if body[at] != '"':
                return False
            scan = Scan()
            end = at + scan.feed(body[at:])
            if not scan.done:
                return None
            try:
                name = json.loads(body[at:end])
            except ValueError:
                return False
            at = end
            continue
        options = part if isinstance(part, tuple) else (part,)
        done = next((o for o in options if body.startswith(o, at)), None)
        if done is None:
            return None if any(o.startswith(body[at:at + len(o)]) for o in options) else False
        at += len(done)
    return name, at - 1
