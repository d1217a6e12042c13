"""`tokendance bench priority`: an urgent request in a busy engine, fcfs against priority."""

from __future__ import annotations

import re

from tokendance.bench import priority


def test_the_urgent_request_finishes_in_fewer_steps_under_priority(bench, tiny_llama):
    out = bench(priority, "--model", str(tiny_llama), "--background", "6", "--max-num-seqs", "2", "--prompt", "20",
                "--tokens", "12", "--urgent-tokens", "4", "--repeats", "1")
    rows = {m[1]: [float(x) for x in m.groups()[1:]] for m in re.finditer(
        r"^\| (fcfs|priority) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", out, re.M)}
    assert set(rows) == {"fcfs", "priority"}
    # fcfs: the urgent request waits for the six ahead of it, two at a time; priority
    # takes a slot at once, by preempting one.
    assert rows["priority"][0] == 4 and rows["fcfs"][0] > 3 * 12
    assert rows["fcfs"][3] == 0 and rows["priority"][3] >= 1
    assert "urgent request's latency, priority / fcfs: " in out
