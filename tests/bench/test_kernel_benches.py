"""The GPU kernel benchmarks run on the CPU interpreter (`--smoke`): the scripts work and
their correctness checks pass, before device time is spent on them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", ["kernels.py", "collective.py", "head_dims.py", "moe.py"])
def test_smoke(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("OUT", None)
    extra = ["--baseline", str(BENCH.parent / "kernels")] if script == "head_dims.py" else []
    res = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *extra], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "all ok" in res.stdout, res.stdout[-2000:]
