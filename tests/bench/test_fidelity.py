"""`bench fidelity` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from tokendance.bench import fidelity


@pytest.mark.parametrize("floor", ["0", "1e9"])
def test_fidelity_report(tiny_llama, bench, floor):
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2",
                "--max-tokens", "4", "--questions", "1", "--floor", floor)
    assert "| full | 1.000 | 1.000 | 0.0000 | 0.0000 |" in out  # full reproduces its own continuation
    for mode in ("pic", "collective"):
        assert f"| 2 | {mode} |" in out
        row = re.search(rf"\| {mode} \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \| ([0-9.]+) \| (\d+) \| (\d+) \| ([^|]+) \|", out)
        mean, top = float(row[1]), float(row[2])
        shared, recomputed, comp = int(row[3]), int(row[4]), row[5].strip()
        assert 0 <= mean <= top and shared > 0
        if floor == "0":  # 15 % of each prompt's reused tokens, rounded up
            assert recomputed > 0 and comp == f"{shared / recomputed:.2f}x"
        else:  # nothing deviates that much: nothing recomputed
            assert recomputed == 0 and comp == "-"


def test_a_later_check_layer_holds_every_reused_token(make_model, bench):
    model = make_model("llama", num_hidden_layers=3)
    out = bench(fidelity, "--model", str(model), "--agents", "2", "--rounds", "1", "--max-tokens", "4",
                "--questions", "1", "--check-layer", "2", "--modes", "collective")
    assert "check layer 2" in out
    row = re.search(r"\| collective \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (\d+) \| (\d+) \| ([^|]+) \|", out)
    assert int(row[2]) > 0 and row[3].strip() == "1.00x"  # a private slot for every reused token


def test_closed_loop_only(tiny_llama, bench):
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2", "--max-tokens", "4",
                "--questions", "0", "--loops", "2", "--modes", "collective")
    assert "Teacher-forced" not in out
    row = next(line for line in out.splitlines() if line.startswith("| 2 | collective |"))
    clean, agents = row.split("|")[3].strip(), row.split("|")[4].strip()
    assert clean.endswith("/2") and agents.endswith("/4")  # 2 debates of 2 agents
    assert "| 2 | pic |" not in out


@pytest.mark.parametrize("bases", ["standalone", "producer", "reader"])
def test_closed_loop_bases(smollm2, bench, bases):
    # The real model: its answers tokenize back to what it generated, so producers
    # publish them (ended by length or not) and the next round's segments find them.
    # Readers: two agents of a round are prefilled in full and hold every segment, which
    # the third reads as a Mirror.
    out = bench(fidelity, "--model", str(smollm2), "--agents", "3", "--rounds", "2", "--max-tokens", "6",
                "--questions", "0", "--modes", "collective", "--bases", bases)
    found = re.search(r"Shared segments by base: (.*)\.$", out, re.M)
    counts = {src: int(n) for n, src in (part.split(" ", 1) for part in found[1].split(", "))}
    # Round 2: each of 3 agents sees every round-1 answer (its own and the others').
    assert counts == {bases: 9}


def test_segments_only_readers_quote_have_no_base(smollm2, bench):
    # Two agents, both readers: no Mirror reads a base, so none is kept.
    out = bench(fidelity, "--model", str(smollm2), "--agents", "2", "--rounds", "2", "--max-tokens", "6",
                "--questions", "0", "--modes", "collective", "--bases", "reader")
    assert "Shared segments by base: 4 computed in place." in out


@pytest.mark.parametrize("modes", ["full", "pic,bogus", ""])
def test_modes_other_than_reuse_ones_are_usage_errors(modes, capsys):
    p = argparse.ArgumentParser()
    fidelity.add_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--modes", modes])
    assert e.value.code == 2 and "expected some of prefix,pic,collective" in capsys.readouterr().err


def test_open_loop_with_reader_bases(tiny_llama, bench):
    # Four agents: two readers (prefilled in full) and two Mirrors; the figures cover the
    # Mirrors, and what the readers do not share with the Master counts as held privately.
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "4", "--rounds", "1", "--max-tokens", "4",
                "--questions", "1", "--modes", "collective", "--bases", "reader")
    row = re.search(r"\| collective \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \| ([0-9.]+) \| (\d+) \| (\d+) \| ([^|]+) \|", out)
    shared, held = int(row[3]), int(row[4])
    # Each prompt holds the other three answers (and its own): the readers' are half the
    # shared tokens, and as Mirrors of the bases they gave they do not hold all of them.
    assert 0 < held < shared and row[5].strip() == f"{shared / held:.2f}x"


def test_anchored_debates_measure_then_predict(tiny_llama, bench):
    # Round 1 has no shared segment, round 2 is prefilled exactly (its offsets become
    # anchors), round 3 reads them: two agents each, in each mode. kvcmas keeps its agents
    # parked from round to round (its bases are its producers'): the tiny model's two
    # agents answer alike, so each restores the segment of its own answer, and measures
    # its place there (the restored prefix was exact).
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "2", "--rounds", "3", "--max-tokens", "4",
                "--questions", "0", "--modes", "kvcomm,kvcmas")
    for mode in ("kvcomm", "kvcmas"):
        assert re.search(rf"^\| 2 \| {mode} \| \d/1 \| \d/2 \|", out, re.M)
        assert f"{mode}: 2 requests read predicted offsets, 2 with reused segments were prefilled exactly" in out


def test_simulate_prompts(tiny_llama, bench):
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "3", "--rounds", "3", "--max-tokens", "4",
                "--questions", "1", "--loops", "2", "--modes", "collective", "--prompts", "simulate")
    assert "simulate prompts" in out
    assert re.search(r"^\| 3 \| collective \| \d/2 \| \d/6 \|", out, re.M)
    # Round 2 quotes each agent's round-1 answer and the others'; round 3 both rounds'.
    found = re.search(r"Shared segments by base: (.*)\.$", out, re.M)
    assert sum(int(part.split(" ", 1)[0]) for part in found[1].split(", ")) == 2 * 3 * (3 + 6)


def test_the_modes_in_an_8_bit_pool(tiny_llama, bench, monkeypatch):
    from tokendance.backend import engine as engine_mod

    pools = []
    real = engine_mod.KVCache

    def spy(*a, **kw):
        pools.append(real(*a, **kw))
        return pools[-1]

    monkeypatch.setattr(engine_mod, "KVCache", spy)
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "2", "--rounds", "1", "--max-tokens", "4",
                "--questions", "1", "--modes", "collective", "--kv-cache-dtype", "fp8")
    assert "KV pool fp8" in out and "| 2 | collective |" in out
    assert [p.kv.dtype for p in pools] == [torch.float8_e4m3fn]
