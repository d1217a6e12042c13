"""`bench offsets` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

import re

from tokendance.bench import offsets


def test_every_rule_gets_a_row_of_distances(make_model, bench):
    model = make_model("llama", num_hidden_layers=4)
    out = bench(offsets, "--model", str(model), "--agents", "2", "--questions", "1", "--max-tokens", "4")
    for kv in ("V", "K"):
        table = out.split(f"\n{kv}:\n")[1]
        for rule in offsets.RULES:
            row = re.search(rf"^\| {re.escape(rule)} \| (.*) \|$", table, re.M)
            values = [float(x) for x in row[1].split(" | ")]
            assert len(values) == 3 and all(0 <= x < 10 for x in values)  # layers 1, 2 and 3
