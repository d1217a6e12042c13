"""The engine's tests run on the CPU and, by bench/h200.sh, on CUDA. Their rounds' shared
segments are tens of tokens, which the engine reuses on the CPU but by default not on
CUDA (segments.CUDA_MIN_SHARED); there they are reused too, but in tests marked
`device_defaults`."""

from __future__ import annotations

import pytest

from tokendance.backend import segments


@pytest.fixture(autouse=True)
def _short_segments_reused(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("device_defaults") is None:
        monkeypatch.setattr(segments, "CUDA_MIN_SHARED", 0)
