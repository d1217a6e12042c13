"""The engine's flags as `tokendance serve` takes them: into the engine's config, sizing
its pool and batches, vLLM's units for token counts, and a bad one in one line."""

from __future__ import annotations

import pytest

from tokendance.examples import cli
from tokendance.proxy import serve

from .test_serve import parse


def test_engine_flags_reach_the_engine_config(monkeypatch):
    from tokendance.backend.service import EngineBackend

    seen = {}
    monkeypatch.setattr(EngineBackend, "load", classmethod(lambda cls, model, **kw: seen.update(kw)))
    serve.load_backend(parse("--offload-gib", "0.5", "--recompute-ratio", "0.2", "--recompute-floor", "0.3"))
    assert seen["offload_bytes"] == 2**29
    assert seen["recompute_ratio"] == 0.2 and seen["recompute_floor"] == 0.3
    assert seen["bases"] == "standalone" and seen["mode"] == serve.DEFAULT_MODE
    assert seen["min_shared_tokens"] is None  # the engine's default for its device
    serve.load_backend(parse("--bases", "producer", "--min-shared-tokens", "32"))
    assert seen["bases"] == "producer" and seen["min_shared_tokens"] == 32
    assert (seen["kv_tokens"], seen["max_model_len"], seen["max_seqs"], seen["max_batched_tokens"]) == (0, 0, 256, 0)
    serve.load_backend(parse("--kv-tokens", "4096", "--max-model-len", "1000", "--max-num-seqs", "8",
                             "--max-num-batched-tokens", "512"))
    assert (seen["kv_tokens"], seen["max_model_len"], seen["max_seqs"], seen["max_batched_tokens"]) == \
        (4096, 1000, 8, 512)
    assert seen["gpu_memory_utilization"] == 0.0
    serve.load_backend(parse("--gpu-memory-utilization", "0.5"))
    assert seen["gpu_memory_utilization"] == 0.5
    assert seen["anchor_bytes"] == 2**30
    serve.load_backend(parse("--anchor-gib", "0.5"))
    assert seen["anchor_bytes"] == 2**29
    assert seen["anchor_rank"] == 32
    serve.load_backend(parse("--anchor-rank", "16"))
    assert seen["anchor_rank"] == 16
    assert seen["tensor_parallel_size"] == 1
    serve.load_backend(parse("-tp", "2"))
    assert seen["tensor_parallel_size"] == 2
    assert seen["seed"] == 0 and "cuda_graphs" not in seen  # the engine's default: graphs on CUDA
    serve.load_backend(parse("--seed", "7", "--enforce-eager"))
    assert seen["seed"] == 7 and seen["cuda_graphs"] == 0
    assert seen["speculative_config"] is None
    serve.load_backend(parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert seen["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}


def test_pool_and_batch_flags_size_the_engine(tiny_llama):
    from tokendance.backend.flags import engine_options
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(**engine_options(parse("--model", str(tiny_llama), "--dtype", "float32",
                                                   "--kv-tokens", "4096", "--max-model-len", "1000",
                                                   "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                                   "--scheduling-policy", "priority")))
    e = be.engine
    assert (e.cache.num_blocks * e.cfg.block_size, e.max_model_len) == (4096, 1000)
    assert e.collector.anchors.budget == 2**30 and e.collector.anchored["kvcmas"].rank == 32
    assert (e.scheduler.max_seqs, e.scheduler.max_tokens, e.scheduler.ranked) == (8, 512, True)
    assert be.info.priority and engine_options(parse())["scheduling_policy"] == "fcfs"


def test_vllms_other_pool_sizes_in_bytes_and_blocks(tiny_llama):
    """--kv-cache-memory-bytes and --num-gpu-blocks-override size the pool as vLLM's do, on
    any device; two sizes at once are one line."""
    from tokendance.backend.flags import engine_options
    from tokendance.backend.service import EngineBackend

    def pool(*argv: str):
        e = EngineBackend.load(**engine_options(parse("--model", str(tiny_llama), "--dtype", "float32", *argv))).engine
        return e.cache.num_blocks, e.kv_bytes_per_token * e.cfg.block_size

    blocks, per_block = pool("--kv-cache-memory-bytes", "4M")  # float32, 2 layers: 512 bytes a token
    assert blocks == 4 * 2**20 // per_block == 512
    assert pool("--num-gpu-blocks-override", "37")[0] == 37
    with pytest.raises(ValueError, match="--kv-tokens and --num-gpu-blocks-override: each sizes the KV pool"):
        engine_options(parse("--kv-tokens", "4096", "--num-gpu-blocks-override", "8"))


def test_token_counts_take_vllms_units():
    assert parse("--max-model-len", "auto").max_model_len == parse("--max-model-len", "-1").max_model_len == 0
    a = parse("--max-model-len", "32k", "--kv-tokens", "4K", "--max-num-batched-tokens", "25.6k")
    assert (a.max_model_len, a.kv_tokens, a.max_num_batched_tokens) == (32_000, 4_096, 25_600)
    assert parse("--max-model-len", "2048").max_model_len == 2048


@pytest.mark.parametrize("flag,value", [("--min-shared-tokens", v) for v in ("-1", "x", "1.5")] + [
    ("--kv-tokens", "-5"), ("--max-model-len", "1e3"), ("--max-model-len", "1.5K"), ("--max-model-len", "0.0005k"),
    ("--max-model-len", "32x"), ("--kv-tokens", "-1k"), ("--max-num-seqs", "0"), ("--max-num-batched-tokens", "-1"),
    ("--tensor-parallel-size", "0"), ("--data-parallel-size", "0"), ("--scheduling-policy", "lifo"),
    ("--speculative-config", "{ngram"), ("--speculative-config", "[3]")])
def test_bad_typed_flags_are_one_line(monkeypatch, capsys, flag, value):
    monkeypatch.setattr(serve, "load_backend", lambda args: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", flag, value])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and flag in err and "\n" not in err


def test_bad_reuse_flag_is_one_line(tiny_llama, capsys):
    from tokendance.examples.cli import main

    code = main(["serve", "--model", str(tiny_llama), "--port", "0", "--recompute-floor", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == "tokendance serve: recompute floor must be >= 0, got -1.0"


def test_a_speculative_config_this_engine_cannot_run_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(serve, "load_backend", lambda args: pytest.fail("the model must not load"))
    code = cli.main(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("tokendance serve: speculative_config: method 'eagle' needs a draft model")
    assert "\n" not in err


def test_a_tensor_parallel_size_the_model_cannot_split_by_is_one_line(tiny_llama, capsys):
    from tokendance.examples.cli import main

    code = main(["serve", "--model", str(tiny_llama), "--port", "0", "-tp", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == ("tokendance serve: --tensor-parallel-size 3 does not divide the model's "
                                 "4 attention heads")
