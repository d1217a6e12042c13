"""`bench engine` compares ours with HF in one run; --breakdown splits a decode step."""

from __future__ import annotations

import argparse

import torch

from tokendance.bench import engine as engine_bench


def test_engine_bench_with_breakdown(tiny_llama, bench):
    out = bench(engine_bench, "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "1x32",
                "--decode", "2x32", "--steps", "3", "--repeats", "1", "--breakdown")
    assert "| prefill 1x32 |" in out and "| decode batch 2, context 32 |" in out
    assert "decode step, batch 2: medians over 3 steps" in out
    wall = float(out.split("| wall time of a step | ")[1].split(" |")[0])
    host = float(out.split("(inputs, launch; the forward on a CPU) | ")[1].split(" |")[0])
    assert 0 < host <= wall  # on a CPU the runner is the forward, inside the step


def test_engine_bench_samples_when_asked(tiny_llama, bench, monkeypatch):
    seen = []
    real = engine_bench.pick
    monkeypatch.setattr(engine_bench, "pick", lambda logits, t: seen.append(t) or real(logits, t))
    out = bench(engine_bench, "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "",
                "--decode", "2x32", "--steps", "3", "--repeats", "1", "--temperature", "0.8")
    assert "| decode batch 2, context 32, temperature 0.8 |" in out
    assert seen and set(seen) == {0.8}  # HF's side sampled at that temperature too
    toks = real(torch.tensor([[0.0, 5.0, 1.0]] * 4000), 1.0)[:, 0]
    assert 0.9 < (toks == 1).float().mean() < 1.0  # a draw, not the argmax


def test_engine_bench_takes_a_larger_pool(tiny_llama, bench, monkeypatch):
    """--kv-tokens: the pool, when larger than the run needs (the CPU's held rotated keys
    are budgeted by the pool's bytes)."""
    from tokendance.backend.engine import Engine

    pools = []
    real = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, cfg=None, **kw: pools.append(cfg.kv_tokens) or real(self, cfg, **kw))
    bench(engine_bench, "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "", "--decode", "2x32",
          "--steps", "3", "--repeats", "1", "--kv-tokens", "6000")
    bench(engine_bench, "--model", str(tiny_llama), "--dtype", "float32", "--prefill", "", "--decode", "2x32",
          "--steps", "3", "--repeats", "1")
    assert pools == [6000, 2 * (32 + 3 + 16) + 1024]


def test_a_shapes_first_layers(bench, capsys):
    """--layers: a shape's widths with fewer layers (random weights); a folder has no shape."""
    out = bench(engine_bench, "--model", "qwen2.5-0.5b", "--layers", "2", "--dtype", "float32", "--prefill", "1x16",
                "--decode", "", "--repeats", "1")
    assert "qwen2.5-0.5b-2l on cpu" in out and "HF transformers (SDPA attention)" in out
    assert "| prefill 1x16 |" in out
    p = argparse.ArgumentParser()
    engine_bench.add_args(p)
    assert engine_bench.main(p.parse_args(["--model", "/tmp", "--layers", "2"])) == 2
    assert "--layers: '/tmp' is not a shape name" in capsys.readouterr().err


def test_hf_attends_eagerly_where_scores_are_capped(bench, make_model):
    """Gemma 2's capped scores: SDPA cannot cap them, so HF's side runs eager attention."""
    gemma = make_model("gemma2", num_hidden_layers=2, attn_logit_softcapping=50.0)
    out = bench(engine_bench, "--model", str(gemma), "--dtype", "float32", "--prefill", "1x16", "--decode", "",
                "--repeats", "1")
    assert "HF transformers (eager attention)" in out and "| prefill 1x16 |" in out
