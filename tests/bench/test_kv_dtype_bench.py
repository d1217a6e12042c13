"""`bench kv-dtype` runs end to end (a tiny random model: the plumbing, not the quality)."""

from __future__ import annotations

import re

from tokendance.bench import kv_dtype


def test_kv_dtype_bench_compares_the_pools(tiny_llama, bench):
    out = bench(kv_dtype, "--model", str(tiny_llama), "--questions", "1", "--agents", "2", "--tokens", "4",
                "--decode", "2x64", "--steps", "2", "--repeats", "1", "--kv-tokens", "4096")
    wide, narrow = (int(re.search(rf"\| {p} \| ([\d,]+) \|", out)[1].replace(",", "")) for p in ("float32", "fp8 pool"))
    assert wide == 4 * narrow
    row = re.search(r"\| ([\d.]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| (\d)/2 \| ", out)
    assert 0 <= float(row[1]) <= 1 and 0 <= float(row[2]) <= float(row[3])
    assert re.search(r"\| 2 x 64 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", out)


def test_a_shape_times_decode_steps_alone(monkeypatch, bench, tiny_llama):
    """Random weights (a shape name): no prompts to judge, the decode steps alone."""
    monkeypatch.setattr(kv_dtype, "resolve", lambda model: (str(tiny_llama), True))
    out = bench(kv_dtype, "--model", "tiny", "--decode", "2x32", "--steps", "2", "--repeats", "1",
                "--kv-tokens", "4096")
    assert "teacher-forced" not in out and re.search(r"\| 2 x 32 \|", out)


def test_it_compares_8_bit_weights_too(tiny_llama, bench):
    """--quantization fp8 with the model's pool: the same KV bytes, fewer weight bytes (the
    projections a quarter of float32's, the embeddings as they were), and prefill timed."""
    out = bench(kv_dtype, "--model", str(tiny_llama), "--kv", "auto", "--quantization", "fp8", "--questions", "1",
                "--agents", "2", "--tokens", "4", "--prefill", "2x32", "--decode", "2x64", "--steps", "2",
                "--repeats", "1", "--kv-tokens", "4096")
    rows = {m[1]: (m[2], float(m[3].replace(",", ""))) for m in re.finditer(
        r"\| (float32|fp8 weights) \| ([\d,]+) \| ([\d.,]+) \|", out)}
    assert rows["float32"][0] == rows["fp8 weights"][0] and rows["fp8 weights"][1] < rows["float32"][1]
    assert "float32 against fp8 weights" in out and re.search(r"\| 2 x 32 \| [\d,]+ \| [\d,]+ \| [\d.]+x \|", out)


def test_nothing_to_compare_is_one_line(tiny_llama):
    import argparse

    import pytest

    p = argparse.ArgumentParser()
    kv_dtype.add_args(p)
    with pytest.raises(ValueError, match="nothing to compare"):
        kv_dtype.main(p.parse_args(["--model", str(tiny_llama), "--kv", "auto"]))


def test_it_compares_a_checkpoint_in_blocks(tiny_llama, bench, tmp_path):
    """--weights DIR: `tokendance quantize --block`'s checkpoint against the wide model it
    came from; fewer weight bytes, the agreement table; --weights with --quantization refused."""
    import argparse

    import pytest

    from tokendance.examples import cli

    folder = tmp_path / "blocks"
    assert cli.main(["quantize", str(tiny_llama), str(folder), "--block", "32"]) == 0
    out = bench(kv_dtype, "--model", str(tiny_llama), "--kv", "auto", "--weights", str(folder), "--questions", "1",
                "--agents", "2", "--tokens", "4", "--decode", "", "--kv-tokens", "4096")
    label = f"the weights of {folder}"
    rows = {m[1]: float(m[3].replace(",", "")) for m in re.finditer(
        rf"\| (float32|{re.escape(label)}) \| ([\d,]+) \| ([\d.,]+) \|", out)}
    assert rows[label] < rows["float32"] and f"float32 against {label}" in out
    assert re.search(r"\| (0\.\d{3}|1\.000) \| [\d.]+e[+-]\d+ \|", out)  # the teacher-forced row
    p = argparse.ArgumentParser()
    kv_dtype.add_args(p)
    with pytest.raises(ValueError, match="give it or --quantization, not both"):
        kv_dtype.main(p.parse_args(["--model", str(tiny_llama), "--weights", str(folder), "--quantization", "fp8"]))


def test_a_missing_checkpoint_is_refused_before_the_model_loads(tiny_llama, tmp_path, monkeypatch):
    import argparse

    import pytest

    def no_engine(*a, **k):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(kv_dtype, "engine", no_engine)
    p = argparse.ArgumentParser()
    kv_dtype.add_args(p)
    with pytest.raises(ValueError, match="no such file or folder"):
        kv_dtype.main(p.parse_args(["--model", str(tiny_llama), "--weights", str(tmp_path / "none")]))
    with pytest.raises(ValueError, match="no config.json in it"):
        kv_dtype.main(p.parse_args(["--model", str(tiny_llama), "--weights", str(tmp_path)]))
