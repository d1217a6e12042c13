"""bench/embed.py times the engine's embeddings against HF transformers' forward, and on a
real model's weights checks that both give the same vectors."""

from __future__ import annotations

import argparse

import pytest

from tokendance.bench import embed


def test_both_sides_are_timed_and_agree(capsys, tiny_llama):
    r = embed.main(["--model", str(tiny_llama), "--dtype", "float32", "--inputs", "5", "--tokens", "3,40",
                    "--batch", "2", "--repeats", "1"])
    assert r["ours_ms"] > 0 and r["hf_ms"] > 0 and r["speedup"] == r["hf_ms"] / r["ours_ms"]
    assert r["max_diff"] < 1e-4  # the same weights: the same vectors, HF's padding and all
    out = capsys.readouterr().out
    assert "5 prompts of 3-40 tokens" in out and "HF in batches of 2" in out


@pytest.mark.parametrize("text", ["0,5", "9,3", "x"])
def test_a_bad_length_range_is_refused(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        embed.lengths(text)
