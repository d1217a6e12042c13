"""Requests waiting to be prefilled by reuse: their agents' parked prefixes found, then
the collector's sub-batches, beside the scheduler's own prefills and decodes."""

from __future__ import annotations

import torch

from tokendance.backend.api import ANCHORED, REUSING
from tokendance.backend.batches import batches
from tokendance.backend.blocks import BlockManager
from tokendance.backend.collector import Collector
from tokendance.backend.idle import IdleAgents
from tokendance.backend.sampler import Sampled, sample
from tokendance.backend.scheduler import Scheduler
from tokendance.backend.sequence import Sequence


class Waiting:
    def __init__(self, collector: Collector, scheduler: Scheduler, idle: IdleAgents,
                 blocks: BlockManager):
        self.collector = collector
        self.scheduler = scheduler
        self.idle = idle
        self.blocks = blocks
        self.seqs: list[Sequence] = []

    def add(self, seq: Sequence, agent: str | None) -> None:
        """Queue a request for reuse, or hand it to the scheduler when it has nothing to
        reuse. `agent` (its session's agent) names its parked prefix, which it restores
        in a REUSING mode while the host tier keeps it."""
        if agent is not None and self.idle.tier.budget and seq.mode in REUSING:
            seq.agent = f"{seq.tenant}\0{agent}"
            r = self.idle.take(seq.agent, seq.prompt, seq.shared, seq.mode in ANCHORED)  # restored with its group
            # A plain request may find as much of its prefix still in the pool, exact.
            if r is not None and r.length <= self.blocks.cached(seq) + self.blocks.size:
                self.idle.tier.drop(r.name)  # found in the pool, as `prefix` finds it: no restore
                r = None
            seq.resume = r
            if r is not None:
                seq.exact = r.exact  # no more exact than the prefix it restores
        if seq.mode in REUSING and (seq.shared or seq.resume is not None):
            self.scheduler.enter(self.seqs, seq)  # under the priority policy, the most urgent first
        else:
            self.scheduler.add(seq)

    def drop(self, seq: Sequence) -> None:
        """An aborted request leaves the queue and gives its parked prefix back."""
        if seq in self.seqs:
            self.seqs.remove(seq)
        self.idle.forgo(seq)

    def step(self, generator: torch.Generator) -> list[tuple[Sequence, Sampled]]:
        """Prefill waiting requests by reuse and sample their first tokens; they join the
        scheduler's running sequences."""
        # One sub-batch per step: the oldest waiting requests whose prompts fit the token
        # budget (the first one alone if it is longer), so running sequences decode between
        # sub-batches as they do between chunks of a plain prefill. Its forwards are its
        # own, beside the scheduler's with its own budget: sharing one would stall decodes
        # or plain prefills while a large round drains. With nothing running or waiting
        # there, the step takes every waiting request and the collector runs their
        # sub-batches back to back: a step boundary would only make the GPU wait for the
        # host (a sync for the first tokens, then the next sub-batch's Mirrors and tables).
        # A request leaves the queue only once prefilled (or handed to the scheduler), so
        # none runs twice or is lost.
        take = self.seqs[:]
        if self.scheduler.has_work():
            take = batches(take, lambda s: len(s.prompt) - (s.resume.length if s.resume else 0),
                           self.scheduler.max_tokens)[0]
        out = []
        for mode in ("collective", "pic", *ANCHORED):
            group = [s for s in take if s.mode == mode]
            if not group:
                continue
            ready, logits = self.collector.prefill(group, mode)
            while not ready and self.scheduler.yield_to(group[0]):  # a less urgent request makes room
                ready, logits = self.collector.prefill(group, mode)
            if not ready and not self.scheduler.running:
                # Not even one fits the pool beside the segment cache: prefill it plainly
                # (its parked prefix, if any, leaves the host tier now, not when it ends).
                # Its spans stay: usage reports them, as it does for a full request's.
                first = group[0]
                self.seqs.remove(first)
                self.idle.forgo(first)
                self.scheduler.add(first)
                continue
            for seq in ready:
                self.seqs.remove(seq)
                self.scheduler.admit(seq)
            out += zip(ready, sample(logits, ready, generator)) if ready else []
        return out
