"""vLLM's --block-size: the engine gives the same tokens, and reuses as much, with pool
blocks of any size, over rounds whose Masters and parked agents went to the host and
came back (the pool, the prefix cache, Mirrors and the host tier all count in blocks)."""

from __future__ import annotations

import argparse

import pytest

from tokendance.backend.api import InvalidRequest
from tokendance.backend.engine import Engine
from tokendance.backend.flags import add_engine_args, engine_options
from tests.backend.test_idle import next_round, run
from tests.backend.test_reuse import round_prompts


def rounds(model, mode: str, block_size: int) -> list:
    """Three rounds of three agents: each round's tokens and per-request reuse."""
    eng = Engine(model=str(model), dtype="float32", kv_tokens=8192, block_size=block_size)
    prompts, spans = round_prompts(3, seed=21)
    out = []
    for rnd in (1, 2, 3):
        if rnd > 1:
            prompts, spans = next_round(prompts, spans, out[-1][0], seed=rnd)
            eng.segments.clear()  # the Masters now live only on the host
        toks, usage = run(eng, prompts, spans, mode, f"r{rnd}-")
        out.append((toks, [(u.prompt_tokens, u.cached_tokens > 0) for u in usage]))
    assert eng.cache.block_size == block_size and eng.cache.num_blocks == 8192 // block_size
    return out


@pytest.mark.parametrize("mode", ["full", "prefix", "collective"])
def test_every_block_size_serves_what_16_does(tiny_llama, mode):
    want = rounds(tiny_llama, mode, 16)
    if mode != "full":
        assert all(cached for _, reuse in want[1:] for _, cached in reuse)  # the test can see reuse
    for size in (1, 8, 32):
        assert rounds(tiny_llama, mode, size) == want, size


def test_the_flag():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_options(p.parse_args([]))["block_size"] == 16
    assert engine_options(p.parse_args(["--block-size", "32"]))["block_size"] == 32
    with pytest.raises(SystemExit):  # argparse names vLLM's choices
        p.parse_args(["--block-size", "12"])
    with pytest.raises(InvalidRequest, match="block_size must be at least 1, not 0"):
        Engine(model=None, block_size=0)
