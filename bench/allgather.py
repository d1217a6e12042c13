"""An All-Gather round generator: N agents, private histories, everyone's outputs.

Agent i's prompt is H_i || Π_i(O_1 .. O_N) || q: its private history, every agent's
last output in an agent-specific order (so the same block sits at a different offset
in each prompt), and a short private question. Token ids are drawn at random from the
vocabulary: timing does not depend on the text.

Beyond All-Gather, a fan-out K < N makes the round a partial broadcast: agent i reads
only the outputs of the K agents after it (i+1 .. i+K, cyclic), so each output is read
by K agents; K = 1 is a ring of chains (each output read once, by the next agent).
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
    reads: list[list[int]]  # per prompt: the output block (its index) each span quotes
    fanout: int = 0  # outputs each agent reads (0: all of them, All-Gather)

    @property
    def agents(self) -> int:
        return len(self.prompts)

    @property
    def shared_tokens(self) -> int:
        return sum(self.outputs)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def read_tokens(self) -> int:
        """Shared tokens summed over the prompts that read them (N·S in All-Gather)."""
        return sum(hi - lo for spans in self.shared for lo, hi in spans)

    def limit(self, ratio: float) -> float:
        """Unique work in tokens: N·P + S + r·N·S in All-Gather (private, bases once,
        recompute); with a fan-out, r of the tokens read."""
        private = self.prompt_tokens - self.read_tokens
        return private + self.shared_tokens + ratio * self.read_tokens


def make_round(agents: int, history: int, output: int, vocab: int, seed: int = 0,
               jitter: float = 0.25, question: int = 16, fanout: int = 0) -> Round:
    """Lengths vary by ±jitter around `history` and `output`; `fanout`: outputs each
    agent reads (0 or `agents`: all, All-Gather)."""
    if not 0 <= fanout <= agents:
        raise ValueError(f"fan-out {fanout} out of range for {agents} agents (0 to {agents})")
    fanout = 0 if fanout == agents else fanout
    g = torch.Generator().manual_seed(seed)

    def length(mean: int) -> int:
        lo, hi = int(mean * (1 - jitter)), int(mean * (1 + jitter)) + 1
        return int(torch.randint(max(lo, 1), hi + 1, (1,), generator=g))

    def tokens(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=g).tolist()

    outs = [tokens(length(output)) for _ in range(agents)]
    prompts, shared, hist, reads = [], [], [], []
    for i in range(agents):
        ids = tokens(length(history))
        hist.append(len(ids))
        spans = []
        read = (torch.randperm(agents, generator=g).tolist() if not fanout
                else [(i + 1 + d) % agents for d in torch.randperm(fanout, generator=g).tolist()])
        for j in read:
            spans.append((len(ids), len(ids) + len(outs[j])))
            ids += outs[j]
        ids += tokens(question)
        prompts.append(ids)
        shared.append(spans)
        reads.append(read)
    return Round(prompts, shared, hist, [len(o) for o in outs], reads, fanout)


def next_round(rnd: Round, answers: list[list[int]], output: int, vocab: int, seed: int = 1,
               question: int = 16) -> Round:
    """The round after `rnd`: agent i's prompt is its last one, its answer, then every
    agent's new output (fresh blocks of ~`output` tokens, agent-specific order) and a new
    question. Its old shared blocks stay shared."""
    new = make_round(rnd.agents, 1, output, vocab, seed=seed, question=question, fanout=rnd.fanout)
    prompts, shared = [], []
    for i, (p, sp, a) in enumerate(zip(rnd.prompts, rnd.shared, answers)):
        base = len(p) + len(a)
        skip = new.history[i]  # make_round's one-token history: dropped
        prompts.append(p + a + new.prompts[i][skip:])
        shared.append(list(sp) + [(lo - skip + base, hi - skip + base) for lo, hi in new.shared[i]])
    return Round(prompts, shared, [len(p) - sum(hi - lo for lo, hi in s)
                                   for p, s in zip(prompts, shared)], rnd.outputs + new.outputs,
                 [r + [len(rnd.outputs) + j for j in nr] for r, nr in zip(rnd.reads, new.reads)], rnd.fanout)
