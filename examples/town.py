"""A small town, GenerativeAgents-like: each round every agent perceives the shared
event feed (a town event plus what everyone did last round) and recalls the memories
that matter most to it, and says what it does next. `python -m tokendance.examples.town`
runs it.

An agent's memories are what it did and the events it saw. Recall is Generative Agents'
retrieval: each memory scores its recency (decaying by round), its importance (the
model's probability that it is worth remembering, judged once per memory by the same
server's `/generative_scoring`, every new memory of a round in one call) and its
relevance to the new event (the cosine of their embeddings, from `/v1/embeddings`),
each scaled to [0, 1] over the agent's memories, and the best `KEEP` are recalled in
the order they happened. What the server does not serve (the echo backend embeds and
judges nothing) drops out of the score; with neither, the town recalls its latest
memories.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable
from dataclasses import dataclass, field

import structlog

from tokendance.adapters.rounds import ProxyError
from tokendance.examples.client import Client
from tokendance.examples.scenario import Messages, agents, gather
from tokendance.proxy.scores import cosine

log = structlog.get_logger(__name__)

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
DECAY = 0.9  # a memory's recency falls by this factor each round
WORTH = "\nIs this worth remembering for a long time? Answer Yes or No.\nAnswer:"  # after the memory


@dataclass(slots=True)
class Memory:
    text: str
    round: int
    vector: list[float] | None = None  # its embedding, once the server gave it
    importance: float | None = None  # the model's probability it is worth remembering, once judged


def ranked(memories: list[Memory], query: list[float] | None, now: int, keep: int = KEEP) -> list[Memory]:
    """The `keep` memories with the best recency + importance + relevance to `query`,
    oldest first; the latest ones when neither of the last two is known."""
    if len(memories) <= keep or (query is None and all(m.importance is None for m in memories)):
        return memories[-keep:]
    recency = [DECAY ** (now - m.round) for m in memories]
    relevance = [cosine(m.vector, query) if query is not None and m.vector is not None else 0.0 for m in memories]
    importance = [m.importance or 0.0 for m in memories]
    score = [sum(x) for x in zip(_scaled(recency), _scaled(relevance), _scaled(importance))]
    best = sorted(range(len(memories)), key=lambda i: -score[i])[:keep]
    return [memories[i] for i in sorted(best)]


def _scaled(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [(x - lo) / (hi - lo) if hi > lo else 0.5 for x in xs]


@dataclass
class Town:
    n: int = 3
    seed: int = 0
    name: str = "town"
    agents: list[str] = field(init=False)
    memory: dict[str, list[Memory]] = field(init=False)
    event: str = "The town wakes up."
    feed: str = "The town wakes up."
    query: list[float] | None = None  # the event's embedding this round
    embeds: bool = True  # until the server refuses to embed
    judges: bool = True  # until it refuses to judge
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.agents = agents(self.n)
        self.memory = {a: [] for a in self.agents}

    async def recall(self, client: Client, round: int) -> None:
        """Embed what is new, the event and last round's memories, and judge the new
        memories' importance: each text once, in one call each."""
        new = [m for a in self.agents for m in self.memory[a] if m.vector is None]
        if self.embeds:
            texts = list(dict.fromkeys([self.event, *(m.text for m in new)]))
            got = await self._ask(client.embed(texts), "embeds")
            if got is not None:
                vectors = dict(zip(texts, got))
                self.query = vectors[self.event]
                for m in new:
                    m.vector = vectors[m.text]
        fresh = [m for a in self.agents for m in self.memory[a] if m.importance is None]
        if self.judges and fresh:
            texts = list(dict.fromkeys(m.text for m in fresh))
            got = await self._ask(client.judge(texts, WORTH), "judges")
            if got is not None:
                worth = dict(zip(texts, got))
                for m in fresh:
                    m.importance = worth[m.text]

    async def _ask(self, call: Awaitable[list], what: str) -> list | None:
        """The server's answer; None, and `what` off from then on, if it does not serve it."""
        try:
            return await call
        except ProxyError as e:
            if e.status not in (400, 404, 501):  # refused, not routed, not implemented
                raise
            log.warning("recall goes without what the server does not serve", missing=what, reason=str(e))
            setattr(self, what, False)
            return None

    def messages(self, agent: str, round: int) -> Messages:
        trait = TRAITS[self.agents.index(agent) % len(TRAITS)]
        recalled = ranked(self.memory[agent], self.query, round)
        recall = "\n".join(f"- {m.text}" for m in recalled) or "- (nothing yet)"
        return [
            {"role": "system", "content": f"You are {agent}, {trait}, living in a small town. "
             "Reply with one sentence: what you do next and why."},
            {"role": "user", "content": f"Your memories:\n{recall}\n\nTown feed:\n{self.feed}\n\n"
             "What do you do now?"},
        ]

    def observe(self, round: int, replies: dict[str, str]) -> None:
        for a in self.agents:
            self.memory[a] += [Memory(f"Round {round}, I saw: {self.event}", round),
                               Memory(f"Round {round}, I did: {replies[a]}", round)]
        self.event = self.rng.choice(EVENTS)
        self.feed = f"{self.event}\n\n" + gather(replies, self.agents, "{name} did")

    def summary(self) -> str:
        how = [w for w, on in (("relevance", self.embeds), ("importance", self.judges)) if on] + ["recency"]
        return (f"{len(self.agents)} townsfolk, {sum(map(len, self.memory.values()))} memories, recalled by "
                + ", ".join(how[:-1]) + (" and " if len(how) > 1 else "") + how[-1])


if __name__ == "__main__":
    from tokendance.examples.simulate import entry

    raise SystemExit(entry("town"))
