"""vLLM's `allowed_token_ids` and `bad_words`: tokens a request may not sample.

`allowed_token_ids` keeps every other token at -inf. A bad word is banned as vLLM bans
it: as the token sequences of the word and of the word after a space (its tokens in the
middle of a text), the last token of a sequence is -inf whenever the output so far ends
with the ones before it (a one-token word: always). Both act with the bias and the
penalties (backend/penalties.py); reported logprobs stay raw.
"""

from __future__ import annotations

from typing import Any


def sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences that spell each of `words`, alone and after a space."""
    out: list[list[int]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def banned(bad: list[list[int]], out: list[int]) -> list[int]:
    """The tokens that would complete one of the sequences `bad` after the output `out`."""
    return sorted({s[-1] for s in bad if len(s) - 1 <= len(out) and out[len(out) - len(s) + 1:] == s[:-1]})
