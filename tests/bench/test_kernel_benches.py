"""The GPU kernel benchmarks run on the CPU interpreter (`--smoke`): the scripts work and
their correctness checks pass, before device time is spent on them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["kernels.py --fp8", "collective.py --fp8", "head_dims.py", "head_dims.py --sweep", "moe.py --tokens 8",
                                    "moe.py --align --tokens 8", "windows.py", "softcap.py", "fp8_decode.py",
                                    "fp8_linear.py", "fp8_block.py", "fp8_block.py --sweep"])
def test_smoke(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("OUT", None)
    script, *extra = script.split()
    extra += ["--baseline", str(BENCH.parent / "kernels")] if script == "head_dims.py" else []
    res = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *extra], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "all ok" in res.stdout or script == "head_dims.py" and "--sweep" in extra, res.stdout[-2000:]
    if script == "head_dims.py" and "--sweep" in extra:  # a row of timings per head dim
        rows = [line for line in res.stdout.splitlines() if line.startswith(("| 128 |", "| 120 |", "| 100 |"))]
        assert len(rows) == 3, res.stdout[-2000:]
    if script == "fp8_block.py" and "--sweep" in extra:  # a row per layer and row count, two configurations
        rows = [line for line in res.stdout.splitlines()
                if line.startswith(("| qkv | 1 |", "| down | 1 |", "| qkv | 17 |", "| down | 17 |"))]
        assert sum(line.count("|") == 5 for line in rows) == 8, res.stdout[-2000:]  # printed, then summed up


@pytest.mark.parametrize("tokens", ["0", "x", ""])
def test_moe_bench_refuses_sizes_that_are_not_positive_counts(tokens: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(BENCH / "moe.py"), "--smoke", "--sweep", "--tokens", tokens], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip() == "--tokens: a comma list of positive token counts, as 1024,4096"


@pytest.mark.parametrize("script", ["head_dims.py", "ptx.py"])
def test_a_baseline_that_is_neither_kernels_nor_a_revision_is_a_line(script: str, tmp_path: Path) -> None:
    """An empty folder (a session once carried one: the GPU's checks ran for minutes and
    then the baseline's import failed) and an unknown revision stop the script at once."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    for arg, says in ((str(tmp_path), "holds no paged_triton.py"), ("no-such-rev", "git cannot read")):
        res = subprocess.run([sys.executable, str(BENCH / script), "--baseline", arg], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stdout == "", res.stdout[-1000:]
        assert res.stderr.startswith("--baseline: ") and says in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")
def test_heads_whose_width_16_does_not_divide_are_read_more_than_2_bytes_at_a_time() -> None:
    """Compiled for sm_90 as the launcher specializes the arguments, at head dims 120 and
    100 (Danube3's, OpenLLaMA-3B's) no kernel loads 2 bytes at a time. Before `in_heads`
    told the compiler that 8 (4) divides their strides, every kernel did: the decode
    kernel's 144 loads of a key or value element each, not pipelined."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(BENCH / "ptx.py"), "--dims", "120,100"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| _")]
    assert len(rows) == 16, res.stdout
    for name, dim, *_, loads, _gathers in rows:
        widths = {int(w.split(":")[0]) for w in loads.split(",")}
        assert min(widths - {1}) >= 4, (name, dim, loads)  # 1: the collective's hidden-slot flags


def test_each_layer_reads_its_own_copy_of_the_weights() -> None:
    """`layers` gives every layer of a step a weight of its own (same values, other memory),
    and `each` hands them out in turn: a graph of LAUNCHES calls reads each copy once."""
    import torch

    from tokendance.bench.kernel_timing import LAUNCHES, each, layers

    w, s = torch.randn(4, 8), torch.rand(4)
    sets = layers((w, s))
    assert len(sets) == LAUNCHES and sets[0] == (w, s)
    assert all(a.equal(w) and b.equal(s) for a, b in sets)
    assert len({a.data_ptr() for a, _ in sets}) == LAUNCHES
    seen = []
    fn = each(lambda a, b: seen.append(a.data_ptr()), sets)
    for _ in range(3 + LAUNCHES):  # a warm-up's calls, then a graph's
        fn()
    assert sorted(seen[3:]) == sorted(a.data_ptr() for a, _ in sets)
