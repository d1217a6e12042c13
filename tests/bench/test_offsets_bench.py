"""`bench offsets` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

import re

import torch

from tokendance.bench import offsets


def test_every_rule_gets_a_row_of_distances(make_model, bench):
    model = make_model("llama", num_hidden_layers=4)
    out = bench(offsets, "--model", str(model), "--agents", "2", "--questions", "1", "--max-tokens", "4",
                "--patches", "0.25", "--ranks", "2")
    for kv in ("V", "K"):
        table = out.split(f"\n{kv}:\n")[1]
        for rule in offsets.rules([0.25], [2]):
            row = re.search(rf"^\| {re.escape(rule)} \| (.*) \|$", table, re.M)
            values = [float(x) for x in row[1].split(" | ")]
            assert len(values) == 3 and all(0 <= x < 10 for x in values)  # layers 1, 2 and 3
    held = re.search(r"full ([\d,]+) bytes; rank 2 ([\d,]+)", out)
    full, low = (int(x.replace(",", "")) for x in held.groups())
    assert 0 < low < full  # rank 2 of 4 tokens x 64 features: smaller


def test_patches_keep_the_largest_offsets_only():
    off = torch.zeros(3, 2, 8, 2, 4)
    off[1, 0, 5, 1, 2] = -4.0  # a large offset in one layer, K only
    off[:, :, 2] = 1.0  # a moderate one everywhere
    off[:, :, 6] = 0.1
    kept = offsets.largest(off, 0.25)  # 2 of 8 tokens
    torch.testing.assert_close(kept[:, :, [2, 5]], off[:, :, [2, 5]])
    assert not kept[:, :, [0, 1, 3, 4, 6, 7]].any()
    assert offsets.largest(off, 0.3)[:, :, 6].abs().sum() > 0  # ceil(2.4): 3 tokens
