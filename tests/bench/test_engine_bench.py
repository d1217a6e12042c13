"""`bench engine` compares ours with HF in one run; --breakdown splits a decode step."""

from __future__ import annotations

from tokendance.bench import engine as engine_bench


def test_engine_bench_with_breakdown(tiny_llama, bench):
    out = bench(engine_bench, "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "1x32",
                "--decode", "2x32", "--steps", "3", "--repeats", "1", "--breakdown")
    assert "| prefill 1x32 |" in out and "| decode batch 2, context 32 |" in out
    assert "decode step, batch 2: medians over 3 steps" in out
    wall = float(out.split("| wall time of a step | ")[1].split(" |")[0])
    host = float(out.split("(inputs, launch; the forward on a CPU) | ")[1].split(" |")[0])
    assert 0 < host <= wall  # on a CPU the runner is the forward, inside the step
