"""bench/prompt.py times tokenizing a segmented prompt whole against segment by segment."""

from __future__ import annotations

from tokendance.bench import prompt


def test_the_round_prompt_and_its_table(capsys, smollm2):
    segs = prompt.segments(agents=3, words=20)
    assert [s.shared for s in segs] == [False, False, True, False, True, False, True]
    prompt.main(["--agents", "3", "--words", "20", "--repeats", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("7 segments, medians of 3")
    assert [line.split("|")[1].strip() for line in out[3:]] == ["whole", "apart", "rust"]
    assert all(float(line.split("|")[2]) > 0 for line in out[3:])
