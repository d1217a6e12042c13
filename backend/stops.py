"""Why a sequence ends at the token it just took, in the order vLLM checks: its grammar
complete, an end token (EOS, stop_token_ids), a stop string, its length, a loop
(backend/repetition.py). The reason is vLLM's finish_reason, the hit its stop_reason:
the stop string or stop token id, or "repetition_detected"."""

from __future__ import annotations

from tokendance.backend.repetition import repeats
from tokendance.backend.sequence import Sequence


def ended(seq: Sequence, tok: int, n: int, max_model_len: int) -> tuple[str | None, str | int | None]:
    """(reason, hit) once `tok`, its n-th output token, is taken; (None, None) to go on."""
    p = seq.sampling
    if seq.matcher is not None and (not seq.matcher.accept_token(tok) or seq.matcher.is_terminated()):
        return "stop", None  # the grammar is complete (only an end-of-sequence token was allowed)
    if tok in seq.ends:  # min_tokens kept them out of its first tokens
        return "stop", tok if tok in p.stop_token_ids else None
    if (hit := seq.detok.add(tok, check=n > p.min_tokens)) is not None:
        return "stop", hit
    if n >= p.max_tokens or len(seq.prompt) + n >= max_model_len:
        return "length", None
    if p.repetition is not None and n >= p.min_tokens and repeats(seq.out, n, p.repetition):
        return "repetition", "repetition_detected"
    return None, None
