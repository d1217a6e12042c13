"""`tokendance bench remote`: the proxy over `tokendance engine` against the engine in-process."""

from __future__ import annotations

import argparse
import re

import pytest

from tokendance.bench import remote


def test_remote_bench_times_every_case_on_both_sides(bench, tiny_llama):
    out = bench(remote, "--model", str(tiny_llama), "--repeats", "1")
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == ["one token", "stream 32, first token", "stream 32, last token",
                                    f"round of {remote.AGENTS}"]
    for _, local, far, ratio in rows:
        (a, b, r), h = map(float, (local, far, ratio)), 0.05  # the times are printed to 0.1 ms
        assert a > h and b > 0
        assert (b - h) / (a + h) - 5e-4 <= r <= (b + h) / (a - h) + 5e-4


def test_no_repeats_is_refused():
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        remote.main(argparse.Namespace(model=None, dtype="float32", repeats=0))


def test_a_child_that_exits_stops_every_start_and_says_which(tmp_path, monkeypatch, tiny_llama):
    """`processes` starts all before waiting on any; one that exits raises, naming it, and
    the others (an engine still starting) are not left running."""
    started = []
    popen = remote.subprocess.Popen

    def spy(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(remote.subprocess, "Popen", spy)
    specs = [(["engine", "--model", str(tmp_path / "none")], None, None),
             (["engine", "--model", str(tiny_llama)], None, None)]
    with pytest.raises(RuntimeError, match="tokendance engine exited with"):
        with remote.processes(specs):
            pass
    assert len(started) == 2 and all(p.poll() is not None for p in started)
