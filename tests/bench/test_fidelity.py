"""`bench fidelity` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

from tokendance.bench import fidelity


def test_fidelity_report(tiny_llama, bench):
    out = bench(fidelity, "--model", str(tiny_llama), "--agents", "2", "--rounds", "2",
                "--max-tokens", "4", "--questions", "1")
    assert "| full | 1.000 |" in out  # full reproduces its own continuation
    for mode in ("pic", "collective"):
        assert f"| 2 | {mode} |" in out
