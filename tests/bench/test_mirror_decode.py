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


def test_prefix_round_moves_the_outputs_to_one_common_front():
    rnd = make_round(3, 20, 12, 1000, seed=2)
    prompts, common = mirror_decode.prefix_round(rnd)
    assert len(common) == rnd.shared_tokens
    for p, q, spans in zip(prompts, rnd.prompts, rnd.shared):
        assert len(p) == len(q) and p[:len(common)] == common
        assert sorted(p) == sorted(q)  # the same tokens, the shared ones moved
        assert p[len(common):len(common) + 5] == q[:5]  # the history follows them


def test_agents_on_one_shared_prefix_read_its_blocks_once(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    rnd = make_round(3, 20, 24, 1000, seed=3)
    prompts, common = mirror_decode.prefix_round(rnd)
    none = [[] for _ in prompts]
    _, dense = mirror_decode.decode_steps(eng, prompts, none, "full", 4, window=2)
    _, shared = mirror_decode.decode_steps(eng, prompts, none, "prefix", 4, window=2, warm=common)
    size = eng.cfg.block_size
    # The common prefix's full blocks are read once, not once per agent.
    assert dense - shared == (len(prompts) - 1) * size * (len(common) // size) > 0


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
    assert "Bytes a step must read" in out and out.count("TB/s |") == 4
    assert "Mirrors / shared prefix" in out


def test_profile_prints_each_modes_top_ops(tiny_llama, bench):
    out = bench(mirror_decode, "--model", str(tiny_llama), "--agents", "2", "--shared", "24",
                "--history", "16", "--steps", "2", "--profile")
    assert out.count("eager, time per op on the device") == 2 and out.count("aten::") >= 4
