"""`bench reuse`: what a round holds (full holds every dense cache, Mirrors hold their own
tokens and patches beside one Master), its flags, the order it times the modes in, and
serial modes (each request served alone)."""

from __future__ import annotations

import argparse

import pytest

from tokendance.backend.engine import Engine
from tokendance.bench import reuse


@pytest.mark.parametrize("ratio", [0.15, 0.05])
def test_footprint_and_compression(tiny_llama, ratio: float):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16384, recompute_ratio=ratio)
    rows = {r["mode"]: r for r in reuse.bench(eng, [4], 24, 40, 1, ["full", "collective"], decode=2)}
    assert rows["full"]["footprint"] == pytest.approx(1.0)
    assert rows["full"]["compression"] is None
    col = rows["collective"]
    # Patches are ceil(ratio * reused) per agent: compression just under 1 / ratio.
    assert 0.8 / ratio < col["compression"] <= 1 / ratio
    assert col["footprint"] > 1.5
    assert "Mirror compression" in reuse.table(list(rows.values()))


def test_anchored_rounds_read_anchors_of_an_earlier_round(make_model):
    """Every agent's segments find anchors (an earlier round's): each kvcomm (kvcmas)
    request reads predicted offsets, computes fewer tokens than full (past the check
    layer only its own) and, its corrected K/V its own, holds a dense cache; kvcmas's
    anchors, at rank 4, hold fewer bytes."""
    eng = Engine(model=str(make_model("llama", num_hidden_layers=8)), dtype="float32", kv_tokens=16384,
                 anchor_rank=4)
    rows = {r["mode"]: r for r in reuse.bench(eng, [3], 24, 40, 1, ["full", "kvcomm", "kvcmas"])}
    assert rows["full"]["predicted"] is None and rows["full"]["anchor_bytes"] is None
    for mode in ("kvcomm", "kvcmas"):
        kv = rows[mode]
        assert kv["predicted"] == 3
        assert kv["computed"] < rows["full"]["computed"]
        assert kv["footprint"] == pytest.approx(1.0) and kv["compression"] is None
        mib = kv["anchor_bytes"] / 2**20
        assert f"| 3 | {mode} (3/3 predicted, anchors {mib:,.0f} MiB) |" in reuse.table(list(rows.values()))
    assert 0 < rows["kvcmas"]["anchor_bytes"] < rows["kvcomm"]["anchor_bytes"] / 2


def test_floor_and_profile_flags(tiny_llama, bench):
    out = bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "3", "--history", "24",
                "--output", "30", "--repeats", "1", "--modes", "full,collective", "--floor", "1e9",
                "--profile", "3")
    assert "ratio 0.15, floor 1000000000.0" in out
    row = next(line for line in out.splitlines() if line.startswith("| 3 | collective |"))
    assert row.split("|")[-2].strip() == ""  # nothing recomputed: no compression figure
    assert "| mode | round ms | device busy ms | busy share |" in out
    for mode in ("full", "collective"):
        assert f"\n{mode}:\n" in out and f"| {mode} | " in out.split("Profiled")[1]


def test_modes_take_turns(tiny_llama, monkeypatch):
    """Repeat by repeat, every mode once: a slow spell falls on all of them alike."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    order = []
    real = reuse.cold
    monkeypatch.setattr(reuse, "cold", lambda e, rnd, mode, sp=reuse.ONE, one=False, rd=False, earlier=None:
                        order.append((mode, one, rd)) or real(e, rnd, mode, sp, one, rd, earlier))
    reuse.bench(eng, [2], 24, 8, 3, ["full", "pic", "collective"], serial=["pic"], readers=["collective"])
    turn = [("full", False, False), ("pic", False, False), ("collective", False, False),
            ("pic", True, False), ("collective", False, True)]
    assert order[5:] == turn * 3  # after one warm-up round each


def test_reader_round(tiny_llama):
    """A round with reader bases: the first two agents are prefilled in full (exact), the
    others read the Master; the engine's own setting is back afterwards."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    rnd = reuse.make_round(4, 24, 16, eng.mcfg.vocab_size, seed=2)
    sampling = reuse.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    played = reuse.cold(eng, rnd, "collective", sampling, readers=True)
    assert not eng.collector.cfg.readers
    assert {e.source for e in eng.segments.entries.values()} == {"reader"}
    assert [u.cached_tokens for u in played.usage[:2]] == [0, 0] and all(u.cached_tokens for u in played.usage[2:])
    full = reuse.cold(eng, rnd, "full", sampling)
    assert played.answers[:2] == full.answers[:2]
    # The readers hold privately less than their whole copies (they became Mirrors of
    # the bases they gave), more than nothing (each holds bases the other gave).
    shared = sum(u.shared_tokens for u in played.usage)
    patches = sum(u.recomputed_tokens for u in played.usage[2:])
    whole = sum(u.shared_tokens for u in played.usage[:2]) + patches
    assert shared / whole < reuse.footprint(eng, played, "collective")[1] < shared / patches


def test_the_master_is_what_the_round_keeps(tiny_llama):
    """The round footprint counts the bases the segment cache holds at the round's end:
    every output once in All-Gather; none in a ring of chains with reader bases (every
    agent reads its one output in full, no Mirror reads a base), which then holds what
    `full` holds."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    rnd = reuse.make_round(4, 24, 16, vocab, seed=2)
    assert reuse.cold(eng, rnd, "collective").bases == rnd.shared_tokens
    ring = reuse.make_round(4, 24, 16, vocab, seed=2, fanout=1)
    played = reuse.cold(eng, ring, "collective", readers=True)
    assert played.bases == 0 and all(u.recomputed_tokens == u.cached_tokens == 0 for u in played.usage)
    assert reuse.footprint(eng, played, "collective")[0] == pytest.approx(1.0)
    standalone = reuse.cold(eng, ring, "collective")
    assert standalone.bases == ring.shared_tokens
    assert reuse.footprint(eng, standalone, "collective")[0] < 1.0  # a base beside each reader's patches


def test_serial_pic(tiny_llama, monkeypatch):
    """A serial mode adds each request only once the one before it has finished, and
    answers as its batched twin does."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    rnd = reuse.make_round(3, 24, 16, eng.mcfg.vocab_size, seed=1)
    busy = []
    add = eng.add
    monkeypatch.setattr(eng, "add", lambda *a, **k: busy.append(eng.has_work()) or add(*a, **k))
    sampling = reuse.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    one = reuse.cold(eng, rnd, "pic", sampling, serial=True)
    assert busy == [False] * 3
    busy.clear()
    batched = reuse.cold(eng, rnd, "pic", sampling)
    assert busy == [False, True, True]
    assert one.answers == batched.answers
    assert [u.recomputed_tokens for u in one.usage] == [u.recomputed_tokens for u in batched.usage]


def test_serial_rows(tiny_llama, bench):
    out = bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "3", "--history", "24",
                "--output", "20", "--repeats", "1", "--modes", "pic,collective", "--serial", "pic")
    lines = out.splitlines()
    assert "| vs serial pic |" in next(line for line in lines if line.startswith("| N |"))
    row = next(line.split("|") for line in lines if line.startswith("| 3 | collective |"))
    assert row[8].strip().endswith("x")  # collective against serial pic
    assert any(line.startswith("| 3 | serial pic |") for line in lines)


def test_reader_rows(tiny_llama, bench):
    out = bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "3", "--history", "24",
                "--output", "20", "--repeats", "1", "--modes", "collective", "--readers", "collective")
    assert any(line.startswith("| 3 | reader collective |") for line in out.splitlines())


def test_fanout_rows(tiny_llama, bench):
    """A row per N, fan-out and mode, the K column only when some round is partial; full
    computes every prompt token, fewer as each agent quotes fewer outputs, and each row's
    limit is its round's."""
    out = bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "3", "--history", "24",
                "--output", "20", "--repeats", "1", "--modes", "full,collective", "--fanout", "1,3")
    lines = out.splitlines()
    assert next(line for line in lines if line.startswith("| N |")).startswith("| N | K | mode |")
    rows = [line.split("|") for line in lines if line.startswith("| 3 |")]
    cells = {(r[2].strip(), r[3].strip()): r for r in rows}  # (K, mode) -> cells
    assert set(cells) == {(k, m) for k in ("1", "3") for m in ("full", "collective")}
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))  # what the bench draws tokens from
    for k in (1, 3):
        rnd = reuse.make_round(3, 24, 20, vocab, seed=3, fanout=k)
        full = cells[(str(k), "full")]
        assert float(full[5]) == rnd.prompt_tokens
        assert float(full[6]) == round(rnd.limit(0.15))
    assert float(cells[("1", "full")][5]) < float(cells[("3", "full")][5])


def test_fanout_beyond_the_agents_is_refused(tiny_llama, capsys):
    from tokendance.examples.cli import main

    assert main(["bench", "reuse", "--model", str(tiny_llama), "--agents", "2,4", "--fanout", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tokendance bench: --fanout 3 exceeds --agents 2: an agent reads at most every output"


@pytest.mark.parametrize("flag,why", [(["--modes", "pic,nope"], "unknown 'nope'"),
                                      (["--serial", "bogus"], "unknown 'bogus'"),
                                      (["--modes", ""], "at least 1 needed")])
def test_bad_modes_are_usage_errors(flag, why, capsys):
    p = argparse.ArgumentParser()
    reuse.add_args(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(flag)
    assert e.value.code == 2
    assert why in capsys.readouterr().err


def test_rounds_in_an_8_bit_pool(tiny_llama, bench):
    out = bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "2", "--history", "24",
                "--output", "30", "--repeats", "1", "--modes", "full,collective", "--kv-cache-dtype", "fp8")
    assert "float32, KV pool float8_e4m3fn;" in out and "| 2 | collective |" in out
