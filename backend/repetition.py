"""vLLM's repetition detection: a request ends (finish_reason "repetition", stop_reason
"repetition_detected") once its output ends in a pattern of `min_pattern_size` to
`max_pattern_size` tokens repeated `min_count` times back to back: a small model's loop
("the the the", "I agree. I agree. I agree.") stops there instead of running to its
max_tokens. Checked after every token, past min_tokens, as vLLM checks it."""

from __future__ import annotations

from collections.abc import Sequence

from tokendance.backend.api import Repetition


def repeats(out: Sequence[int], n: int, r: Repetition) -> bool:
    """Whether out[:n] ends in a pattern `r` names. Sizes are tried from the smallest up:
    once a size's repeats need more than n tokens, so do the larger ones'."""
    for size in range(max(r.min_pattern_size, 1), r.max_pattern_size + 1):
        if size * r.min_count > n:
            return False
        if all(out[n - 1 - i] == out[n - 1 - i - size * k] for i in range(size) for k in range(1, r.min_count)):
            return True
    return False
