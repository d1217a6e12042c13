"""bench/gaps.py finds where the device waits and which host code runs meanwhile;
`bench reuse --trace` writes the traces it reads."""

from __future__ import annotations

import argparse
import gzip
import json

import pytest

from tokendance.bench import gaps, reuse


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=1)


def test_gaps_and_the_host_code_running_in_them(tmp_path):
    events = [
        _x("cpu_op", "aten::empty", 0, 10),
        _x("python_function", "backend/engine.py(10): step", 0, 1000),
        _x("python_function", "backend/blend.py(70): blend", 100, 500),
        _x("python_function", "/venv/site-packages/torch/nn/module.py(1): forward", 150, 50),
        _x("python_function", "backend/mirror.py(5): pick", 300, 200),
        _x("kernel", "gemm", 120, 100),
        _x("kernel", "gemm", 50, 50),
        _x("gpu_memcpy", "HtoD", 600, 300),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    # Busy 50-100, 120-220, 600-900; host from 0: gaps 0-50, 100-120 (too short), 220-600.
    assert gaps.idle(events, gaps.busy(events), 30) == [(0, 50), (220, 600)]
    out = gaps.report(str(path), top=5, min_us=30)
    assert "0.9 ms from the first host event" in out and "idle 0.4 ms in 2 gaps" in out
    assert "| 0.2 | 0.38 | backend/mirror.py(5): pick |" in out  # at the gap's middle, 410
    assert "| 0.0 | 0.05 | backend/engine.py(10): step |" in out
    # Sampled every 10 µs: pick 300-500, blend around it, step before blend began.
    assert "| backend/mirror.py(5): pick | 0.20 |" in out
    assert "| backend/blend.py(70): blend | 0.18 |" in out
    assert "| backend/engine.py(10): step | 0.05 |" in out
    assert "forward" not in out  # library frames are not ours


def test_reuse_trace_flag_writes_one_trace_per_mode(tiny_llama, bench, tmp_path):
    bench(reuse, "--model", str(tiny_llama), "--dtype", "float32", "--agents", "2", "--history", "16",
          "--output", "12", "--repeats", "1", "--modes", "full,collective", "--profile", "2",
          "--trace", str(tmp_path))
    for mode in ("full", "collective"):
        names = {e.get("name", "") for e in gaps.load(str(tmp_path / f"{mode}-n2.json.gz"))}
        assert any("collector.py" in n for n in names) == (mode == "collective")
        assert any("engine.py" in n and "step" in n for n in names)


def test_trace_without_profile_is_refused(tmp_path):
    p = argparse.ArgumentParser()
    reuse.add_args(p)
    with pytest.raises(ValueError, match="--trace needs --profile"):
        reuse.main(p.parse_args(["--trace", str(tmp_path)]))


def test_cli_reads_a_trace_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    from tokendance.examples import cli

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("kernel", "k", 50, 10), _x("cpu_op", "a", 0, 5)]}))
    assert cli.main(["bench", "gaps", str(path), "--min-us", "10"]) == 0
    assert "device idle 0.1 ms in 1 gaps" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "plain.json.gz").write_text("{}")
    for bad in (tmp_path / "missing.json.gz", tmp_path / "bad.json", tmp_path / "text.json",
                tmp_path / "plain.json.gz"):
        assert cli.main(["bench", "gaps", str(bad)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tokendance bench: ") and err.count("\n") == 1 and str(bad) in err
