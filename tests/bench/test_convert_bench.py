"""bench/convert.py (GGUF conversion, this tree's against a revision's): a revision git
cannot read is one line before anything is converted."""

from __future__ import annotations

from tokendance.bench import convert


def test_a_baseline_git_cannot_read_is_one_line(capsys):
    assert convert.main(["--baseline", "no-such-rev"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("--baseline: git cannot read no-such-rev:backend/convert.py")
    assert len(out.err.strip().splitlines()) == 1
