"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every running sequence has `pending` tokens to process (a prompt chunk, or the one
token sampled last step). A step takes decodes first, then prompt chunks, within a
token budget. When the pool runs dry, the newest running sequence is preempted: its
blocks are freed and it is recomputed later, so a full pool slows things down and
never fails a request. Before that, cached blocks nobody runs on are reclaimed
(`reclaim`: the segment cache's unpinned bases).

Under vLLM's --scheduling-policy priority both queues are kept in `rank` order (a
request's priority, lower first, then its arrival): the first served are the most
urgent, the preempted the least; and a waiting request that finds no room preempts
running ones of a strictly lower priority (a larger value) until it fits (a reuse
group's most urgent request too, backend/waiting.py).
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass

from tokendance.backend.blocks import BlockManager
from tokendance.backend.sequence import Sequence, Status


def rank(seq: Sequence) -> tuple[int, int]:
    """Under the priority policy, who goes first: the lower priority value, then the earlier arrival."""
    return seq.sampling.priority, seq.arrival


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    start: int  # first position processed this step
    count: int  # tokens processed this step

    @property
    def samples(self) -> bool:
        """Whether this step completes the sequence's pending tokens and samples the next."""
        return self.start + self.count >= len(self.seq) and self.seq.pooling is None

    @property
    def drafts(self) -> int:
        """Proposed tokens this step feeds after the sequence's last (backend/speculate.py)."""
        return max(self.start + self.count - len(self.seq), 0)

    @property
    def pools(self) -> bool:
        """Whether this step completes an embedding request's prompt (backend/pooling.py)."""
        return self.start + self.count == len(self.seq) and self.seq.pooling is not None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_seqs: int, max_tokens: int, policy: str = "fcfs"):
        self.blocks = blocks
        self.ranked = policy == "priority"
        # frees cached blocks (unpinned segment bases) until n are free; the engine sets it
        self.reclaim: Callable[[int], int] | None = None
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0  # ever (vLLM's num_preemptions)

    def add(self, seq: Sequence) -> None:
        self.enter(self.waiting, seq)

    def admit(self, seq: Sequence) -> None:
        """Into the running sequences (prefilled by reuse, or admitted by schedule)."""
        seq.status = Status.RUNNING
        self.enter(self.running, seq)

    def enter(self, queue: MutableSequence[Sequence], seq: Sequence, first: bool = False) -> None:
        """Put seq in a queue: in rank order under the priority policy, else at its end
        (or, `first`, at its head)."""
        if self.ranked:
            insort(queue, seq, key=rank)
        elif first:
            queue.insert(0, seq)
        else:
            queue.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """Out of the queues; its blocks freed unless `keep_blocks` (its caller frees
        them with a later remove)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.blocks.free(seq)

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for seq's first `tokens` tokens, reclaiming cached ones if the pool is short."""
        if self.blocks.reserve(seq, tokens):
            return True
        if self.reclaim is None:
            return False
        self.reclaim(self.blocks.blocks_for(seq.own_slots(tokens)) - len(seq.blocks))
        return self.blocks.reserve(seq, tokens)

    def preempt(self, seq: Sequence) -> None:
        seq.draft = []
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.enter(self.waiting, seq, first=True)

    def schedule(self) -> tuple[list[Scheduled], list[Sequence]]:
        """The next step's work, and sequences that can never fit (finish them)."""
        out: list[Scheduled] = []
        starved: list[Sequence] = []
        budget = self.max_tokens
        # Running sequences first, oldest first; victims are taken from the newest end,
        # which this loop has not reached yet.
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.pending + len(seq.draft), budget)
            while not self._reserve(seq, seq.computed + n):
                victim = self.running[-1]
                if victim is seq:
                    break
                self.preempt(victim)
            else:
                out.append(Scheduled(seq, seq.computed, n))
                budget -= n
                continue
            # Even alone, the pool cannot hold it any longer (a Mirror also holds its Master's
            # blocks: preempted, it is recomputed plain, which may fit).
            if len(self.running) == 1 and seq.mirror is None:
                self.running.remove(seq)
                self.blocks.free(seq)
                starved.append(seq)
            else:
                self.preempt(seq)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_seqs:
                if not self.yield_to(seq, out):
                    break
                budget = self.max_tokens - sum(w.count for w in out)
                continue
            self.blocks.match_prefix(seq)
            n = min(seq.pending, budget)
            if not self._reserve(seq, seq.computed + n):
                self.blocks.free(seq)
                seq.computed = 0
                if self.yield_to(seq, out):
                    budget = self.max_tokens - sum(w.count for w in out)
                    continue
                if not self.running and not out:
                    self.waiting.popleft()
                    starved.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.admit(seq)
            out.append(Scheduled(seq, seq.computed, n))
            budget -= n
        return out, starved

    def yield_to(self, seq: Sequence, out: list[Scheduled] | None = None) -> bool:
        """Under the priority policy, preempt the least urgent running sequence if its
        priority is strictly lower than waiting `seq`'s (its work this step, if any,
        dropped from `out`); whether one was."""
        if not self.ranked or not self.running or self.running[-1].sampling.priority <= seq.sampling.priority:
            return False
        victim = self.running[-1]
        if out is not None:
            out[:] = [w for w in out if w.seq is not victim]
        self.preempt(victim)
        return True
