"""The engine's tests run on the CPU and, by bench/h200.sh, on CUDA. Their rounds' shared
segments are tens of tokens, which the engine reuses on the CPU but by default not on
CUDA (segments.CUDA_MIN_SHARED): the tests lift that minimum on every device, but in
tests marked `device_defaults`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokendance.backend import segments


@pytest.fixture(autouse=True)
def _short_segments_reused(request: pytest.FixtureRequest) -> Iterator[None]:
    # its own MonkeyPatch: a test's monkeypatch.undo() must not take it back
    with pytest.MonkeyPatch.context() as mp:
        if request.node.get_closest_marker("device_defaults") is None:
            mp.setattr(segments, "CUDA_MIN_SHARED", 0)
        yield


@pytest.fixture(scope="module")
def gguf_cache(make_model, tmp_path_factory) -> Iterator[Path]:
    """GGUF conversions into a cache folder of the module's own (after make_model: the
    embedded model's goes where it always does)."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("cache")
        mp.setenv("TOKENDANCE_CACHE", str(root))
        yield root
