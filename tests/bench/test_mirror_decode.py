"""`bench mirror-decode` times decode steps of Mirrors and dense caches of one round."""

from __future__ import annotations

from tokendance.backend.engine import Engine
from tokendance.bench import mirror_decode
from tokendance.bench.allgather import make_round


def test_decode_steps_of_mirrors_and_dense(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    rnd = make_round(3, 20, 12, 1000, seed=1)
    for mode in ("collective", "full"):
        times = mirror_decode.decode_steps(eng, rnd.prompts, rnd.shared, mode, 6, window=2)
        assert len(times) == 3 and all(t > 0 for t in times)
        assert not eng.seqs and eng.pool.num_free == eng.cache.num_blocks - len(
            [b for e in eng.segments.entries.values() for b in e.blocks])


def test_main_prints_the_table(tiny_llama, bench):
    out = bench(mirror_decode, "--model", str(tiny_llama), "--agents", "2", "--shared", "24",
                "--history", "16", "--steps", "2")
    assert "| 2 |" in out and "Mirrors / dense" in out


def test_profile_prints_each_modes_top_ops(tiny_llama, bench):
    out = bench(mirror_decode, "--model", str(tiny_llama), "--agents", "2", "--shared", "24",
                "--history", "16", "--steps", "2", "--profile")
    assert out.count("eager, time per op on the device") == 2 and out.count("aten::") >= 4
