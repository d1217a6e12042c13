"""A chat answer's reasoning read out of its text, as vLLM's `--reasoning-parser` gives
it (`tokendance serve --reasoning-parser qwen3|deepseek_r1`): the model's thinking, between
`<think>` and `</think>`, goes to the message's `reasoning`, the rest to `content`, where
tool calls are read and which the session remembers (what agents pass on is the answer,
not the thinking).

- `qwen3`: an answer that opens with `<think>` (after any whitespace) reasons up to
  `</think>`; any other answer (thinking switched off, `enable_thinking: false`) is all
  content.
- `deepseek_r1`: the template opens the block in the prompt, so an answer reasons from
  its start (a `<think>` it writes itself dropped) up to `</think>`.

An answer cut off before `</think>` is all reasoning. Fed the same text in any pieces, a
`Thinking` gives the same reasoning and content; text that could still become a tag is
held back until it is known. vLLM's `thinking_token_budget` (`budget`) knows a think
block by the same tags, as the tokenizer writes them.

A structured output lets the model think first, as vLLM's does with a reasoning parser:
its grammar holds the answer from `</think>` on (`held_after`), unless the prompt has
already closed the block (Qwen3 with thinking switched off), when it holds it from its
first token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokendance.backend.api import Structure, ThinkBudget

from .calls import tail
from .errors import invalid

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def budget(parser: str | None, backend: Any, tokens: int | None) -> ThinkBudget | None:
    """vLLM's thinking_token_budget as the engine counts it (backend/thinking.py): None
    for none (-1 too); a 400 without a reasoning parser (or a tokenizer) to know a think
    block by."""
    if tokens is None or tokens == -1:
        return None
    if tokens < 0:
        raise invalid("thinking_token_budget must be at least 0 (-1: no budget)", "thinking_token_budget")
    tokenizer = getattr(backend, "tokenizer", None)
    if parser is None or tokenizer is None:
        raise invalid("thinking_token_budget needs a reasoning parser (serve --reasoning-parser) to know "
                      "the thinking by", "thinking_token_budget")
    return ThinkBudget(tokens, tokenizer.encode(OPEN, add_special_tokens=False),
                       tokenizer.encode(CLOSE, add_special_tokens=False))


class Thinking:
    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(PARSERS)}")
        self.opening = True  # before the answer's first text: a <think> may open it
        self.inside = parser == "deepseek_r1"  # reasoning now
        self.closed = False  # past </think>: all content from here
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds."""
        if self.closed:
            return "", text
        self.held += text
        if self.opening:
            rest = self.held.lstrip()
            if len(rest) < len(OPEN) and OPEN.startswith(rest):
                return "", ""  # still undecided
            self.opening = False
            if rest.startswith(OPEN):
                self.inside, self.held = True, rest[len(OPEN):]
        if not self.inside:
            self.closed, text, self.held = True, self.held, ""
            return "", text
        at = self.held.find(CLOSE)
        if at >= 0:
            reasoning, content = self.held[:at], self.held[at + len(CLOSE):]
            self.closed, self.held = True, ""
            return reasoning, content
        keep = tail(self.held, CLOSE)
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""

    def end(self) -> tuple[str, str]:
        """What was held back, once the answer is complete."""
        held, self.held = self.held, ""
        if self.inside and not self.closed:
            return held, ""
        return "", held

    def whole(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.end()
        return r1 + r2, c1 + c2


def held_after(st: Structure, prompt: str) -> Structure:
    """A structured output as it holds after the thinking: from the end of a think block
    that the prompt leaves open or to the model, or from the first token when the prompt
    has closed it. A structural tag holds only its tagged parts, so it is left as it is."""
    if st.kind == "structural_tag" or prompt.rfind(CLOSE) > prompt.rfind(OPEN):
        return st
    return replace(st, after=CLOSE)
