"""Decode steps that overlap the host with the GPU.

A synchronous decode step leaves the GPU idle while the host reads the sampled tokens,
detokenizes, checks stops, schedules and fills the next step's inputs: 1.6 ms of a
9.8 ms step at batch 32 x 4k on an H200 (`bench engine --breakdown`). Instead a decode
step's tokens stay on the device: the next step takes them as its input ids and is
launched before the host looks at them, and the host then handles them while that step
runs. Each sampled token stands in its sequence's `out` as PENDING until it lands.

The price is one step of lookahead: a sequence that stops (EOS, a stop string, its
limit) had one more token computed, which is dropped with its KV; its finish is
reported one call of `Engine.step` later. Sampling draws the same numbers in the same
order as without overlap, so greedy and seeded outputs are unchanged as long as the
logits are, bit for bit: the extra step can run a batch through other kernels (its
Mirrors leave it a step later), and on uninitialised bf16 weights a late token of one
request differed between the two ways in three runs of four (bench/check_cuda.py
compares them in fp32, on drawn weights). Penalties, which
depend on every earlier token, count the chosen ids on the device (backend/penalties.py),
so penalized requests take this path too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.sampler import choose
from tokendance.backend.sequence import Sequence

PENDING = -1  # a sampled token the host has not read yet


@dataclass(slots=True)
class Inflight:
    """A decode step's sampled tokens, on their way to the host."""

    seqs: list[Sequence]  # in the step's row order
    tokens: torch.Tensor  # [n] on the device: the next step's input ids
    host: torch.Tensor  # [n] on the host, complete once `ready` has passed
    ready: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def eligible(seqs: list[Sequence]) -> bool:
    """Whether a step's tokens may land late: log-probabilities are read on the host
    with their tokens, and a grammar's next mask needs its last token (one that holds
    only after its marker, too: the token that ends the marker decides the next mask),
    as do bad words' bans (backend/banned.py) and a thinking budget's count."""
    return all(not s.sampling.logprobs and s.sampling.structure is None and not s.bad and s.thought is None
               for s in seqs)


def launch(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator | None) -> Inflight:
    """Sample the rows without waiting; a PENDING token joins each sequence."""
    tokens = choose(logits, seqs, default)
    for s in seqs:
        s.out.append(PENDING)
        s.lookahead += 1
    if not tokens.is_cuda:
        return Inflight(seqs, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Inflight(seqs, tokens, host, ready)
