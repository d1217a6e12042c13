"""A small town, GenerativeAgents-like: each round every agent perceives the shared
event feed (a town event plus what everyone did last round) and its own memory, and
says what it does next. `python -m tokendance.examples.town` runs it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokendance.examples.scenario import Messages, agents, gather

TRAITS = (
    "the baker", "the school teacher", "a mural painter", "the bicycle mechanic",
    "the beekeeper", "a reporter for the town paper", "the football coach", "the librarian",
)
EVENTS = (
    "It starts to rain in the main square.",
    "The mayor announces a street festival for Saturday.",
    "A stray dog wanders into the market.",
    "The power goes out on the east side for an hour.",
    "A travelling musician plays by the fountain.",
    "The river rises after a night of storms.",
)
KEEP = 3  # memories an agent recalls


@dataclass
class Town:
    n: int = 3
    seed: int = 0
    name: str = "town"
    agents: list[str] = field(init=False)
    memory: dict[str, list[str]] = field(init=False)
    feed: str = "The town wakes up."
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.agents = agents(self.n)
        self.memory = {a: [f"I am {a}, {TRAITS[i % len(TRAITS)]}."] for i, a in enumerate(self.agents)}

    def messages(self, agent: str, round: int) -> Messages:
        recall = "\n".join(f"- {m}" for m in self.memory[agent][-KEEP:])
        return [
            {"role": "system", "content": f"You are {agent}, living in a small town. "
             "Reply with one sentence: what you do next and why."},
            {"role": "user", "content": f"Your memories:\n{recall}\n\nTown feed:\n{self.feed}\n\n"
             "What do you do now?"},
        ]

    def observe(self, round: int, replies: dict[str, str]) -> None:
        event = self.rng.choice(EVENTS)
        for a in self.agents:
            self.memory[a].append(f"Round {round}: {replies[a]}")
        self.feed = f"{event}\n\n" + gather(replies, self.agents, "{name} did")

    def summary(self) -> str:
        return f"{len(self.agents)} townsfolk, {sum(map(len, self.memory.values()))} memories"


if __name__ == "__main__":
    from tokendance.examples.simulate import entry

    raise SystemExit(entry("town"))
