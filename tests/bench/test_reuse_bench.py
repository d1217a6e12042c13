"""`bench reuse`: what a round holds (full holds every dense cache, Mirrors hold their own
tokens and patches beside one Master), its flags, and the order it times the modes in."""

from __future__ import annotations

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
    monkeypatch.setattr(reuse, "cold", lambda e, rnd, mode, sp=reuse.ONE: order.append(mode) or real(e, rnd, mode, sp))
    reuse.bench(eng, [2], 24, 8, 3, ["full", "pic", "collective"])
    assert order[3:] == ["full", "pic", "collective"] * 3  # after one warm-up round each
