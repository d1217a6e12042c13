"""Known outputs: what a session's rounds produced, indexed for the search of a prompt.

A prompt is sampled every GRAM characters. An output of 2 * GRAM - 1 characters or more
that occurs at p covers the sampled position j = p + k (k < GRAM), where
text[j:j+GRAM] == output[k:k+GRAM]. Indexing each output under its first GRAM grams so
finds, from the sample alone, every output that may occur in the prompt: the cost of a
search does not grow with the outputs absent from it (every prompt of a round is searched
for the outputs of three rounds, on the event loop that serves all sessions). Shorter
outputs (only with a minimum below 15 characters) are always searched for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Producer = tuple[str, str, int]  # (session, agent, round)
GRAM = 8
ENTRY_BYTES = 1500  # what an output costs besides its characters: its entry, its GRAM grams


def cost(text: str) -> int:
    return len(text) + ENTRY_BYTES


@dataclass(slots=True, eq=False)
class Outputs:
    """One round's outputs: text -> producer, and the index."""

    producers: dict[str, Producer] = field(default_factory=dict)
    grams: dict[str, list[str]] = field(default_factory=dict)  # gram -> outputs it starts
    short: list[str] = field(default_factory=list)  # too short for the index
    size: int = 0  # estimated bytes

    def add(self, text: str, producer: Producer) -> None:
        if not text or text in self.producers:
            return
        self.producers[text] = producer
        self.size += cost(text)
        if len(text) < 2 * GRAM - 1:
            self.short.append(text)
            return
        for g in dict.fromkeys(text[k:k + GRAM] for k in range(GRAM)):
            self.grams.setdefault(g, []).append(text)

    def __contains__(self, text: str) -> bool:
        return text in self.producers

    def __len__(self) -> int:
        return len(self.producers)


class Known:
    """The outputs of some rounds, newest first: a text two rounds produced is the newer one's."""

    def __init__(self, rounds: Iterable[Outputs] = ()):
        self.rounds = [o for o in rounds if o.producers]

    @classmethod
    def of(cls, producers: Mapping[str, Producer]) -> Known:
        o = Outputs()
        for text, p in producers.items():
            o.add(text, p)
        return cls([o])

    def __bool__(self) -> bool:
        return bool(self.rounds)

    def __contains__(self, text: str) -> bool:
        return any(text in o for o in self.rounds)

    def get(self, text: str) -> Producer | None:
        for o in self.rounds:
            p = o.producers.get(text)
            if p is not None:
                return p
        return None

    def candidates(self, text: str) -> dict[str, Producer]:
        """The outputs that may occur in `text` (all that do, and some that do not)."""
        sample = {text[j:j + GRAM] for j in range(0, len(text), GRAM)}
        found: dict[str, Producer] = {}
        for o in self.rounds:
            for g in sample:
                for t in o.grams.get(g, ()):
                    found.setdefault(t, o.producers[t])
            for t in o.short:
                found.setdefault(t, o.producers[t])
        return found
