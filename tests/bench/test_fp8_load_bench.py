"""bench/fp8_load.py end to end on a tiny model: four loads, each in its own process, the
table, and the rounded and stored loads' projections byte for byte alike."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_it_loads_four_ways_and_compares_the_bytes(tiny_llama, tmp_path):
    """With --baseline (this checkout again here) each way also loads by that code's
    package, first on the child's path, and gets its time against it."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "tokendance.bench.fp8_load", "--model", str(tiny_llama),
                          "--dtype", "float32", "--device", "cpu", "--repeats", "1", "--work", str(tmp_path),
                          "--baseline", str(root)], capture_output=True, text=True, check=True).stdout
    assert "tokendance quantize: 14 projections" in out and (tmp_path / f"{tiny_llama.name}-fp8").is_dir()
    rows = {m[1]: (float(m[2].replace(",", "")), m[3]) for m in re.finditer(
        r"^(\w+(?:@base)?) +[\d.]+ +[\d,.]+ +([\d,.]+) +[\d.]+x +([\d.]+x)?", out, re.M)}
    assert rows.keys() == {f"{w}{c}" for w in ("wide", "after", "rounded", "stored") for c in ("", "@base")}
    held = {w: h for w, (h, _) in rows.items()}
    assert held["after"] == held["rounded"] == held["stored"] == held["stored@base"] < held["wide"]
    assert all((vs is None) == w.endswith("@base") for w, (_, vs) in rows.items())  # a ratio per way now
    assert "rounded = stored, byte for byte: True" in out
