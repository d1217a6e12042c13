"""`bench restore` on CPU at tiny sizes: the table appears and the bytes follow the formula."""

from __future__ import annotations

import json
import math

from tokendance.bench import restore
from tokendance.examples import cli


def test_main_prints_the_table(tmp_path, bench):
    out = tmp_path / "rows.json"
    text = bench(restore, "--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                 "--agents", "2,3", "--history", "20", "--output", "7", "--generated", "5",
                 "--ratio", "0.15,0.05", "--repeats", "2", "--json", str(out))
    assert "| N | r | MB fused | MB dense | ms fused | ms dense | speed-up |" in text
    assert "| 2 | 0.15 |" in text and "| 3 | 0.05 |" in text
    tok = 2 * 2 * 2 * 16 * 2  # layers, K and V, heads, head_dim, bf16
    rows = json.loads(out.read_text())["rows"]
    assert [(r["agents"], r["ratio"]) for r in rows] == [(2, 0.15), (2, 0.05), (3, 0.15), (3, 0.05)]
    for r in rows:
        n = r["agents"]
        private = 20 + math.ceil(r["ratio"] * n * 7) + 5
        assert r["bytes_fused"] == (n * 7 + n * private) * tok  # the Master once
        assert r["bytes_dense"] == n * (20 + n * 7 + 5) * tok
        assert r["ms_fused"] > 0 and r["ms_dense"] > 0


def test_a_bad_device_is_one_line(capsys):
    assert cli.main(["bench", "restore", "--device", "nope"]) == 1
    err = capsys.readouterr().err
    assert err == "tokendance bench: unsupported device 'nope'; choose auto, cpu, cuda or cuda:N\n"
