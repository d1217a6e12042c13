"""What a simulation is to the round loop: agents, each one's prompt, what a round did.

A scenario owns its state (private histories, memories, the shared feed); the loop in
`loop.py` only asks for prompts and reports replies. One whose agents look their
memories up has `async recall(client, round)` too, which the loop awaits before the
round's prompts (town.py embeds there). The block of round-t outputs
that every prompt of round t+1 quotes is built by `gather`, one way for all
scenarios, so the proxy sees the same strings it served (and can share them).
"""

from __future__ import annotations

import random
from typing import Protocol

Messages = list[dict[str, str]]

NAMES = (
    "Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo",
    "Kai", "Lu", "Max", "Nia", "Oz", "Pia", "Quin", "Rae", "Sol", "Tia",
)


class Scenario(Protocol):
    name: str
    agents: list[str]

    def messages(self, agent: str, round: int) -> Messages:
        """The chat that `agent` sends in `round` (rounds count from 1)."""

    def observe(self, round: int, replies: dict[str, str]) -> None:
        """Every agent's reply of `round`, in agent order."""

    def summary(self) -> str:
        """One line on how the simulation went."""


def agents(n: int) -> list[str]:
    """`n` distinct agent names: Ada, Bo, ..., then Ada2, Bo2, ..."""
    if n < 1:
        raise ValueError("--agents must be at least 1")
    return [NAMES[i % len(NAMES)] + (str(i // len(NAMES) + 1) if i >= len(NAMES) else "") for i in range(n)]


def order(agent: str, names: list[str], rng: random.Random | None = None) -> list[str]:
    """Agent `agent`'s view order of the others (Pi_i): starting after itself, or
    shuffled by `rng`. Offsets of the shared blocks differ from agent to agent."""
    i = names.index(agent)
    rest = names[i + 1:] + names[:i]
    if rng is not None:
        rng.shuffle(rest)
    return rest


def gather(replies: dict[str, str], names: list[str], label: str = "{name} said") -> str:
    """The round's outputs verbatim (as the proxy served them), one block each."""
    return "\n\n".join(f"{label.format(name=n)}:\n{replies[n]}" for n in names)
