"""A segmented prompt's token ids, and where its shared segments lie among them.

The prompt is tokenized whole, as any engine would tokenize its text, so segmentation
never changes what the model reads. Tokenizing each segment alone would: a byte-level
BPE splits "Ada: I" into "Ada: " + "I" where the whole text has " I", and a SentencePiece
tokenizer (Llama 2, Mistral) puts a "▁" before every segment, a space the text never had.

A shared segment holds the tokens that lie wholly inside its text. A token that straddles
one of its edges (" I" where the segment starts at "I") is private: the tokens inside are
the same wherever the segment stands, which is what makes its KV reusable.
"""

from __future__ import annotations

from typing import Any

from tokendance.backend.api import Segment


def tokenize(tokenizer: Any, segments: list[Segment], special: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, [start, end) of each shared segment's tokens) by a fast (Rust) HF tokenizer,
    which gives each token's characters; `special` adds the tokens the tokenizer puts
    around a text (a BOS), as vLLM does for completions."""
    text = "".join(s.text for s in segments)
    if not text:
        return [], []
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    spans = []
    i, at = 0, 0
    for s in segments:
        a, b = at, at + len(s.text)
        at = b
        if not s.shared:
            continue
        while i < len(ids) and _first(offsets[i]) < a:
            i += 1
        j = i
        # Tokens an added BOS or EOS stands for have no characters: never inside.
        while j < len(ids) and offsets[j][1] <= b and offsets[j][1] > offsets[j][0]:
            j += 1
        if j > i:
            spans.append((i, j))
        i = j
    return ids, spans


def _first(off: tuple[int, int]) -> int:
    """Where a token starts; one that stands for no characters is before any segment."""
    return off[0] if off[1] > off[0] else -1
