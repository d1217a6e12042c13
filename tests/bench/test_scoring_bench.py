"""bench/scoring.py times a prefill with prompt logprobs against one without."""

from __future__ import annotations

from tokendance.bench import scoring


def test_both_prefills_are_timed(capsys, tiny_llama, monkeypatch):
    import gc

    frozen, real = [], scoring.heap.frozen
    monkeypatch.setattr(scoring.heap, "frozen", lambda: frozen.append(1) or real())
    ms = scoring.main(["--model", str(tiny_llama), "--dtype", "float32", "--tokens", "40", "--prompts", "2",
                       "--repeats", "2"])
    assert ms["plain"] > 0 and ms["scored"] > 0 and ms["ratio"] == ms["scored"] / ms["plain"] and frozen == [1]
    assert gc.get_freeze_count() == 0  # unfrozen after
    out = capsys.readouterr().out
    assert "2 x 40 tokens, top 5, cpu torch.float32, vocabulary" in out and "scored prefill" in out
