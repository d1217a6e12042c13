"""The debates `bench fidelity` and `bench offsets` run: whose prompts, and how a round's
prompts become prepared requests.

Two prompt sets. `bench` (the default): opinion questions, each debater seeing its own
last answer and the others' (only the last round's), as the fidelity figures before
session 40 were measured. `simulate`: `tokendance simulate debate`'s own scenario
(examples/debate.py): puzzle questions, named debaters of different styles, every
earlier round kept in the chat, the others' answers labelled and ordered from each
agent's place. Either way a prompt's shared segments are the outputs of earlier rounds
it quotes, found as the proxy finds them.
"""

from __future__ import annotations

from tokendance.backend.api import Request, SamplingParams, Segment
from tokendance.backend.service import EngineBackend
from tokendance.examples import debate as simulated
from tokendance.examples.scenario import Messages, Scenario
from tokendance.proxy.known import Known, Outputs
from tokendance.proxy.segment import detect

QUESTIONS = (
    "Should cities ban cars from their centres?",
    "Is it better to learn by reading or by doing?",
    "Will robots replace teachers?",
    "Should homework be abolished?",
    "Is space exploration worth its cost?",
    "Are cats better pets than dogs?",
    "Should voting be mandatory?",
    "Is remote work better than office work?",
)
PROMPTS = ("bench", "simulate")


class Opinion:
    """The bench's own debate: debater i answers `question`; from round 2 its chat is
    its last answer and the board of the others' last answers."""

    name = "opinion"

    def __init__(self, n: int, question: str):
        self.agents = [f"d{i}" for i in range(n)]
        self.question = question
        self.last: list[str] | None = None

    def messages(self, agent: str, round: int) -> Messages:
        i = self.agents.index(agent)
        msgs = [{"role": "system", "content": f"You are debater {i + 1}. Answer in at most two sentences."},
                {"role": "user", "content": self.question}]
        if self.last is not None:
            board = "\n".join(f"Debater {j + 1}: {a}" for j, a in enumerate(self.last) if j != i)
            msgs += [{"role": "assistant", "content": self.last[i]},
                     {"role": "user", "content": f"The other debaters said:\n{board}\nGive your revised answer."}]
        return msgs

    def observe(self, round: int, replies: dict[str, str]) -> None:
        self.last = [replies[a] for a in self.agents]

    def summary(self) -> str:
        return f"question: {self.question}"


def questions(prompts: str) -> tuple[str, ...]:
    return QUESTIONS if prompts == "bench" else simulated.QUESTIONS


def debate(prompts: str, n: int, k: int) -> Scenario:
    """A debate of n agents on the prompt set's question k (cyclically)."""
    qs = questions(prompts)
    if prompts == "bench":
        return Opinion(n, qs[k % len(qs)])
    return simulated.Debate(n, question=qs[k % len(qs)])


class Board:
    """A debate as the engine sees it: the outputs of every round so far (which the
    proxy would find in later prompts) and the next round's prompts."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.round = 1
        self.known: list[Outputs] = []  # newest first

    def requests(self, be: EngineBackend, mode: str, sampling: SamplingParams) -> list:
        known = Known(self.known)
        out = []
        for i, a in enumerate(self.scenario.agents):
            text = be.render_chat(self.scenario.messages(a, self.round))
            segs = detect([Segment(text)], known)
            out.append(be.prepare(Request(f"{mode}-{i}", segs, sampling, mode=mode)))
        return out

    def observe(self, answers: list[str]) -> None:
        o = Outputs()
        for a, text in zip(self.scenario.agents, answers):
            o.add(text, ("s", a, self.round))
        self.known.insert(0, o)
        self.scenario.observe(self.round, dict(zip(self.scenario.agents, answers)))
        self.round += 1
