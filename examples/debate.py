"""Multi-agent debate, the canonical All-Gather: every agent answers, reads every
other answer, revises. `python -m tokendance.examples.debate` runs it end to end."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokendance.examples.scenario import Messages, agents, gather, order

QUESTIONS = (
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. "
    "How much does the ball cost?",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long would it take "
    "100 machines to make 100 widgets?",
    "What is 17 times 24?",
    "Is a tomato a fruit or a vegetable? Answer as a botanist would.",
    "Which is heavier: a kilogram of feathers or a kilogram of iron?",
)
STYLES = ("careful", "skeptical", "concise", "curious", "patient", "blunt")


@dataclass
class Debate:
    n: int = 3
    seed: int = 0
    name: str = "debate"
    question: str = ""  # default: one of QUESTIONS, drawn by seed
    agents: list[str] = field(init=False)
    chats: dict[str, Messages] = field(init=False)
    last: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.agents = agents(self.n)
        self.question = self.question or rng.choice(QUESTIONS)
        self.chats = {
            a: [
                {"role": "system", "content": f"You are {a}, a {STYLES[i % len(STYLES)]} debater. "
                 "Answer in two sentences at most."},
                {"role": "user", "content": self.question},
            ]
            for i, a in enumerate(self.agents)
        }

    def messages(self, agent: str, round: int) -> Messages:
        return list(self.chats[agent])

    def observe(self, round: int, replies: dict[str, str]) -> None:
        self.last = dict(replies)
        for a in self.agents:
            others = gather(replies, order(a, self.agents), "{name} answered")
            self.chats[a] += [
                {"role": "assistant", "content": replies[a]},
                {"role": "user", "content": f"The other debaters answered:\n\n{others}\n\n"
                 "Using their answers as extra evidence, give your revised answer."},
            ]

    def summary(self) -> str:
        return f"question: {self.question}"


if __name__ == "__main__":
    from tokendance.examples.simulate import entry

    raise SystemExit(entry("debate"))
