"""`bench mirror-decode` times decode steps of Mirrors and dense caches of one round."""

from __future__ import annotations

from tokendance.backend.engine import Engine
from tokendance.bench import mirror_decode
from tokendance.bench.allgather import make_round


def test_decode_steps_of_mirrors_and_dense(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    rnd = make_round(3, 20, 12, 1000, seed=1)
    read = {}
    for mode in ("collective", "full"):
        times, read[mode] = mirror_decode.decode_steps(eng, rnd.prompts, rnd.shared, mode, 6, window=2,
                                                       master=rnd.shared_tokens)
        assert len(times) == 3 and all(t > 0 for t in times)
        assert not eng.seqs and eng.pool.num_free == eng.cache.num_blocks - len(
            [b for e in eng.segments.entries.values() for b in e.blocks])
    # A dense step reads every prompt and the tokens out so far (one, or two with lookahead).
    prompts = sum(len(p) for p in rnd.prompts)
    assert prompts + 3 <= read["full"] <= prompts + 6
    # Mirrors read their private tokens, their patches and the Master once: less.
    private = prompts - sum(hi - lo for spans in rnd.shared for lo, hi in spans)
    assert rnd.shared_tokens + private + 3 <= read["collective"] < read["full"]


def test_weight_bytes_counts_every_linear_layer(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024)
    cfg = eng.mcfg
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    expect = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size  # + the LM head
    assert mirror_decode.weight_bytes(eng.model) == 4 * expect


def test_main_prints_the_table(tiny_llama, bench):
    out = bench(mirror_decode, "--model", str(tiny_llama), "--agents", "2", "--shared", "24",
                "--history", "16", "--steps", "2")
    assert "| 2 |" in out and "Mirrors / dense" in out
    assert "Bytes a step must read" in out and out.count("TB/s |") == 3


def test_profile_prints_each_modes_top_ops(tiny_llama, bench):
    out = bench(mirror_decode, "--model", str(tiny_llama), "--agents", "2", "--shared", "24",
                "--history", "16", "--steps", "2", "--profile")
    assert out.count("eager, time per op on the device") == 2 and out.count("aten::") >= 4
