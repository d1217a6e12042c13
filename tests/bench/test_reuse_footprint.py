"""`bench reuse` reports what a round holds: full holds every dense cache, Mirrors hold
their own tokens and patches beside one Master."""

from __future__ import annotations

import pytest

from tokendance.backend.engine import Engine
from tokendance.bench import reuse


@pytest.mark.parametrize("ratio", [0.15, 0.05])
def test_footprint_and_compression(tiny_llama, ratio: float):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16384, recompute_ratio=ratio)
    rows = {r["mode"]: r for r in reuse.bench(eng, [4], 24, 40, 1, ["full", "collective"], decode=2)}
    assert rows["full"]["footprint"] == pytest.approx(1.0)
    assert rows["full"]["compression"] is None
    col = rows["collective"]
    # Patches are ceil(ratio * reused) per agent: compression just under 1 / ratio.
    assert 0.8 / ratio < col["compression"] <= 1 / ratio
    assert col["footprint"] > 1.5
    assert "Mirror compression" in reuse.table(list(rows.values()))
