"""One request's tokens, block table and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokendance.backend.api import REUSING, Pooling, SamplingParams, Usage
from tokendance.backend.detok import Detok
from tokendance.backend.keys import Key, segment_key
from tokendance.backend.mirror import Mirror
from tokendance.backend.pool import flat_slots

if TYPE_CHECKING:
    from tokendance.backend.idle import Resume
    from tokendance.backend.penalties import Seen
    from tokendance.backend.thinking import Thought


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


EXACT = 1 << 62  # Sequence.exact of a request computed exactly, output included


@dataclass(slots=True, eq=False)
class Sequence:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    detok: Detok
    generator: torch.Generator | None = None
    ends: list[int] = field(default_factory=list)  # the tokens that end it: stop_token_ids, and EOS unless ignored
    out: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the pool
    cached: int = 0  # prompt tokens whose K/V was reused rather than computed
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    mode: str = "full"  # one of api.MODES
    shared: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) of shared segments
    tenant: str = ""
    arrival: int = 0  # the engine's count of requests before it (scheduler.rank)
    keys: list[Key] | None = None  # the shared segments' keys, once made (segment_keys)
    sender: str = ""  # who sent it (its session's agent): kvcomm's placeholders are per agent
    publish: bool = False  # keep the KV of the output as a base for the next round
    recomputed: int = 0  # reused prompt tokens recomputed selectively
    reader: bool = False  # prefilled in full to give the round's bases (`--bases reader`)
    hashes: list[bytes] = field(default_factory=list)  # chain key of each full block (backend/keys.py)
    mirror: Mirror | None = None  # pic / collective: shared segments read from the Master
    agent: str | None = None  # whose next request may resume from this one's KV
    resume: Resume | None = None  # this request's prefix, parked by its agent's last one
    # its K/V are an exact prefill's up to here (kvcomm / kvcmas lower it to the first
    # segment they predict, or to what was exact of the prefix they restored)
    exact: int = EXACT
    lookahead: int = 0  # trailing tokens of `out` sampled but not read yet (backend/lookahead.py)
    seen: Seen | None = None  # a penalized request's token counts on the device (backend/penalties.py)
    matcher: Any = None  # a structured output's grammar state (backend/grammar.py)
    until: list[int] = field(default_factory=list)  # the tokens after which the grammar holds (Structure.after)
    bad: list[list[int]] = field(default_factory=list)  # its bad_words' token sequences (backend/banned.py)
    scored: list[Any] | None = None  # its prompt tokens' logprobs, as prefill computes them (backend/scoring.py)
    pooling: Pooling | None = None  # an embedding request: its prompt pooled, nothing sampled (backend/pooling.py)
    thought: Thought | None = None  # its thinking, counted against a budget (backend/thinking.py)
    draft: list[int] = field(default_factory=list)  # tokens proposed for its next step (backend/speculate.py)

    @property
    def prefix_cache(self) -> bool:
        """Exact prefix caching: a `prefix` request, or a reusing one computed plainly (no
        shared segment, no Mirror, nothing left to restore), whose KV is as exact up to
        `exact` (a prefix it restored may hold predicted K/V after; BlockManager.publish)."""
        return self.mode == "prefix" or (self.mode in REUSING and not self.shared
                                         and self.resume is None and self.mirror is None)

    def segment_keys(self) -> list[Key]:
        """Each shared segment's key (backend/keys.py), hashed once for the request."""
        if self.keys is None:
            self.keys = [segment_key(self.tenant, self.prompt[lo:hi]) for lo, hi in self.shared]
        return self.keys

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out if self.out else self.prompt

    def __len__(self) -> int:
        return len(self.prompt) + len(self.out)

    def slots(self, rows: torch.Tensor, view: int, block_size: int, trash: int) -> torch.Tensor:
        """Pool slots where tokens `rows` keep their K/V in this view (a Mirror keeps
        reused tokens in the Master: their rows go to the trash slot)."""
        if len(rows) == 1:  # a decode step: plain Python beats five tensor ops
            return torch.tensor([self.slot(int(rows[0]), view, block_size, trash)])
        own = rows if self.mirror is None else self.mirror.own_index(view, rows)
        i = own.clamp_min(0)
        return torch.where(own >= 0, flat_slots(self.blocks, i, block_size), trash)

    def slot(self, row: int, view: int, block_size: int, trash: int) -> int:
        """`slots` of one token, as a plain int."""
        i = row if self.mirror is None else self.mirror.own_slot(row, view)
        return self.blocks[i // block_size] * block_size + i % block_size if i >= 0 else trash

    def read_slots(self, rows: torch.Tensor, view: int, block_size: int) -> torch.Tensor:
        """Pool slots that attention reads tokens `rows` from in this view."""
        own = self.slots(rows, view, block_size, -1)
        if self.mirror is None:
            return own
        return torch.where(own >= 0, own, self.mirror.master_slots(block_size)[rows])

    def own_slots(self, tokens: int) -> int:
        """Private slots (in `blocks`) the sequence needs once it has `tokens` tokens."""
        return tokens if self.mirror is None else self.mirror.own_slots(tokens)

    @property
    def shared_tokens(self) -> int:
        """Prompt tokens inside shared segments."""
        return sum(hi - lo for lo, hi in self.shared)

    @property
    def held(self) -> int:
        """Tokens of KV this request holds privately: prefix hits live in shared blocks,
        a Mirror's reused tokens in the Master (it holds its own tokens and patches)."""
        if self.mirror is not None:
            return self.mirror.held(len(self))
        return len(self) - self.cached if self.prefix_cache else len(self)

    def shared_blocks(self, block_size: int) -> list[int]:
        """The pool blocks it reads but does not hold (`held` leaves them out): a Mirror's
        Master, or the blocks a prefix-cached request found in the cache."""
        if self.mirror is not None:
            return self.mirror.master_blocks
        return self.blocks[: self.cached // block_size] if self.prefix_cache else []

    def usage(self, per_token: int, block_size: int) -> Usage:
        """Its tokens and KV as a response reports them (KV in bytes, `per_token` a token)."""
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.out), cached_tokens=self.cached,
                     recomputed_tokens=self.recomputed, shared_tokens=self.shared_tokens,
                     kv_dense_bytes=len(self) * per_token, kv_held_bytes=self.held * per_token,
                     shared_blocks=tuple(self.shared_blocks(block_size)), block_bytes=per_token * block_size)

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self) - self.computed
