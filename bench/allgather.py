"""An All-Gather round generator: N agents, private histories, everyone's outputs.

Agent i's prompt is H_i || Π_i(O_1 .. O_N) || q: its private history, every agent's
last output in an agent-specific order (so the same block sits at a different offset
in each prompt), and a short private question. Token ids are drawn at random from the
vocabulary: timing does not depend on the text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Round:
    prompts: list[list[int]]
    shared: list[list[tuple[int, int]]]  # per prompt: [lo, hi) of each output block
    history: list[int]  # private history length per agent
    outputs: list[int]  # length of each output block

    @property
    def agents(self) -> int:
        return len(self.prompts)

    @property
    def shared_tokens(self) -> int:
        return sum(self.outputs)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def limit(self, ratio: float) -> float:
        """Unique work in tokens: N·P + S + r·N·S (private, bases once, recompute)."""
        private = self.prompt_tokens - self.agents * self.shared_tokens
        return private + self.shared_tokens + ratio * self.agents * self.shared_tokens


def make_round(agents: int, history: int, output: int, vocab: int, seed: int = 0,
               jitter: float = 0.25, question: int = 16) -> Round:
    """Lengths vary by ±jitter around `history` and `output`."""
    g = torch.Generator().manual_seed(seed)

    def length(mean: int) -> int:
        lo, hi = int(mean * (1 - jitter)), int(mean * (1 + jitter)) + 1
        return int(torch.randint(max(lo, 1), hi + 1, (1,), generator=g))

    def tokens(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=g).tolist()

    outs = [tokens(length(output)) for _ in range(agents)]
    prompts, shared, hist = [], [], []
    for _ in range(agents):
        ids = tokens(length(history))
        hist.append(len(ids))
        spans = []
        for j in torch.randperm(agents, generator=g).tolist():
            spans.append((len(ids), len(ids) + len(outs[j])))
            ids += outs[j]
        ids += tokens(question)
        prompts.append(ids)
        shared.append(spans)
    return Round(prompts, shared, hist, [len(o) for o in outs])


def next_round(rnd: Round, answers: list[list[int]], output: int, vocab: int, seed: int = 1,
               question: int = 16) -> Round:
    """The round after `rnd`: agent i's prompt is its last one, its answer, then every
    agent's new output (fresh blocks of ~`output` tokens, agent-specific order) and a new
    question. Its old shared blocks stay shared."""
    new = make_round(rnd.agents, 1, output, vocab, seed=seed, question=question)
    prompts, shared = [], []
    for i, (p, sp, a) in enumerate(zip(rnd.prompts, rnd.shared, answers)):
        base = len(p) + len(a)
        skip = new.history[i]  # make_round's one-token history: dropped
        prompts.append(p + a + new.prompts[i][skip:])
        shared.append(list(sp) + [(lo - skip + base, hi - skip + base) for lo, hi in new.shared[i]])
    return Round(prompts, shared, [len(p) - sum(hi - lo for lo, hi in s)
                                   for p, s in zip(prompts, shared)], rnd.outputs + new.outputs)
