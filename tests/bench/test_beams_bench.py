"""bench/beams.py times vLLM's beam search through the proxy against HF's and against
greedy decoding, and compares the beams with HF's."""

from __future__ import annotations

import re

from tokendance.bench import beams


def test_three_ways_are_timed_and_the_beams_compared(tiny_llama, bench):
    out = bench(beams, "--model", str(tiny_llama), "--width", "3", "--tokens", "4", "--repeats", "1")
    assert re.search(r"^beam width 3, 4 tokens after a \d+-token prompt, .* cpu torch.float32, medians of 1:",
                     out, re.M), out
    rows = re.findall(r"^  (beam search \(proxy\)|HF generate\(num_beams\)| 3 greedy sequences) +([\d.]+) ms",
                      out, re.M)
    assert len(rows) == 3 and all(float(ms) > 0 for _, ms in rows), out
    assert re.search(r"ours / HF [\d.]+x", out) and re.search(r"beam search / greedy [\d.]+x", out)
    # float32 on both sides: HF's beams, token for token
    assert "beams equal to HF's, token for token and in order: 3/3" in out
