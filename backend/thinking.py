"""vLLM's thinking_token_budget: a reasoning model thinks at most so many tokens. Inside
a think block (opened by the model, or by the prompt, as DeepSeek-R1's template opens
it) the tokens are counted; at the budget the block's end tokens are forced, one a step,
and the answer goes on from there. Counting starts again at the next block."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokendance.backend.api import ThinkBudget


def _ends(ids: list[int], tail: list[int]) -> bool:
    return bool(tail) and len(ids) >= len(tail) and ids[len(ids) - len(tail):] == tail


def _last(ids: list[int], part: list[int]) -> int:
    """Where `part` last starts in `ids`; -1 if nowhere."""
    n = len(part)
    return next((i for i in range(len(ids) - n, -1, -1) if ids[i:i + n] == part), -1)


@dataclass(slots=True)
class Thought:
    """A sequence's thinking: whether it is inside a block, how long it has been, and the
    end tokens still to force."""

    budget: ThinkBudget
    inside: bool = False
    count: int = 0
    forced: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, budget: ThinkBudget, prompt: list[int]) -> Thought:
        """The state the prompt leaves: inside a block its template opened, or not."""
        opened, closed = _last(prompt, budget.start), _last(prompt, budget.end)
        t = cls(budget)
        if opened > closed:
            t.inside, t.count = True, len(prompt) - opened - len(budget.start)
            t._check(prompt)
        return t

    def next(self) -> int | None:
        """The token the next step must take, if forced."""
        return self.forced[0] if self.forced else None

    def take(self, out: list[int]) -> None:
        """`out`'s last token was just generated."""
        if self.forced:
            self.forced.pop(0)
            self.inside = bool(self.forced)
            return
        if _ends(out, self.budget.start):
            self.inside, self.count = True, 0
        elif self.inside and _ends(out, self.budget.end):
            self.inside = False
        elif self.inside:
            self.count += 1
        self._check(out)

    def _check(self, ids: list[int]) -> None:
        """At the budget, force the end, less what `ids` already ends with of it."""
        if self.inside and self.count >= self.budget.tokens:
            end = self.budget.end
            begun = next((k for k in range(len(end) - 1, 0, -1) if _ends(ids, end[:k])), 0)
            self.forced = end[begun:]
