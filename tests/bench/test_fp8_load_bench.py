"""bench/fp8_load.py end to end on a tiny model: four loads, each in its own process, the
table, and the rounded and stored loads' projections byte for byte alike."""

from __future__ import annotations

import re
import subprocess
import sys


def test_it_loads_four_ways_and_compares_the_bytes(tiny_llama, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokendance.bench.fp8_load", "--model", str(tiny_llama),
                          "--dtype", "float32", "--device", "cpu", "--repeats", "1", "--work", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "tokendance quantize: 14 projections" in out and (tmp_path / f"{tiny_llama.name}-fp8").is_dir()
    rows = {m[1]: float(m[2].replace(",", "")) for m in re.finditer(
        r"^(wide|after|rounded|stored) +[\d.]+ +[\d,.]+ +([\d,.]+) +[\d.]+x", out, re.M)}
    assert rows.keys() == {"wide", "after", "rounded", "stored"}
    assert rows["after"] == rows["rounded"] == rows["stored"] < rows["wide"]  # the same tensors held
    assert "rounded = stored, byte for byte: True" in out
