"""`python -m tokendance.bench.proxy`: every scenario's row, measured against a proxy in a
child process (a few requests, one repeat: the command works, not how fast)."""

from __future__ import annotations

import math
import subprocess
import sys

from tokendance.bench.proxy import SCENARIOS


def test_every_scenario_gets_a_row_of_numbers():
    run = subprocess.run([sys.executable, "-m", "tokendance.bench.proxy", "--requests", "100", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.strip("|").split(" | ")[1:]
            for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    for name, sessions, _, api in SCENARIOS:
        cells = rows[name]
        overhead, reqs = float(cells[0]), float(cells[-1])
        assert 0 < overhead < math.inf and reqs > 0, (name, cells)  # numbers measured, not a time limit
        barrier = sessions > 0 and api != "batch"  # a batch of chats is its round's group
        assert (cells[2] != "—") == barrier, (name, cells)  # a release only where a barrier holds


def test_too_few_requests_for_the_rounds_is_one_line():
    run = subprocess.run([sys.executable, "-m", "tokendance.bench.proxy", "--requests", "20"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--requests must be at least 50" in run.stderr.splitlines()[-1]
