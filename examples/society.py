"""News spreading through a society, AgentSociety-like: a few agents hear a piece of
news; each round every agent posts, reading the posts of those it follows. Prints how
many agents mention the news by the end. `python -m tokendance.examples.society`."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokendance.examples.scenario import Messages, agents, gather

NEWS = "The old bridge on Mill Road will close on Friday for repairs."
KEYWORD = "bridge"
FOLLOWS = 4  # accounts each agent follows


@dataclass
class Society:
    n: int = 3
    seed: int = 0
    name: str = "society"
    agents: list[str] = field(init=False)
    follows: dict[str, list[str]] = field(init=False)
    heard: set[str] = field(init=False)
    timeline: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.agents = agents(self.n)
        self.follows = {
            a: rng.sample([b for b in self.agents if b != a], min(FOLLOWS, self.n - 1))
            for a in self.agents
        }
        self.heard = set(rng.sample(self.agents, max(1, self.n // 5)))

    def messages(self, agent: str, round: int) -> Messages:
        know = f"You heard this morning: {NEWS}\n\n" if agent in self.heard else ""
        posts = gather(self.timeline, self.follows[agent], "{name} posted") if self.timeline else "(quiet)"
        return [
            {"role": "system", "content": f"You are {agent}, a resident posting on the town's "
             "social network. Write one short post."},
            {"role": "user", "content": f"{know}Posts from people you follow:\n{posts}\n\nYour post:"},
        ]

    def observe(self, round: int, replies: dict[str, str]) -> None:
        self.timeline = dict(replies)
        self.heard |= {a for a, text in replies.items() if KEYWORD in text.lower()}

    def summary(self) -> str:
        return f"{len(self.heard)}/{len(self.agents)} agents know about the {KEYWORD}"


if __name__ == "__main__":
    from tokendance.examples.simulate import entry

    raise SystemExit(entry("society"))
