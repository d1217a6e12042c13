"""What a producer's finished output becomes, with producer bases: the token runs of it
that the next round's prompts hold, each kept with the K/V the producer computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Run:
    at: int  # where it starts in the output
    ids: list[int]

    @property
    def end(self) -> int:
        return self.at + len(self.ids)


def _find(out: list[int], ids: list[int]) -> int | None:
    n = len(ids)
    return next((i for i in range(len(out) - n + 1) if out[i] == ids[0] and out[i:i + n] == ids), None)


def runs(out: list[int], text: str, encode: Callable[[str], list[int]]) -> list[Run]:
    """The output as prompts hold it: its text tokenized alone (a client's explicit
    shared segment), and stripped of the whitespace around it (how the proxy finds an
    earlier answer in a prompt, proxy/segment.py; a stop string often leaves some), each
    where it lies among the generated tokens, and each without its first token: a prompt
    is tokenized whole, and where text stands right before the answer ("Ada: " before
    "I think") the first token takes it in (" I") and is the reader's own
    (backend/prompt.py). Text that tokenizes apart from the generated tokens (a trailing
    " " where " blue" was generated) has no K/V of its own and is left out."""
    found: dict[tuple[int, ...], Run] = {}
    for t in dict.fromkeys((text, text.strip())):
        ids = encode(t) if t else []
        at = _find(out, ids) if ids else None
        if at is not None:
            found.setdefault(tuple(ids), Run(at, ids))
            if len(ids) > 1:
                found.setdefault(tuple(ids[1:]), Run(at + 1, ids[1:]))
    return list(found.values())
