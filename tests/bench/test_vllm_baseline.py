"""The vLLM-CPU baseline's plumbing: `bench reuse --decode`, the joint table, the vLLM side's helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokendance.backend.engine import Engine
from tokendance.bench import reuse, vllm_cpu

BENCH = Path(reuse.__file__).parent


def test_reuse_decode_sets_max_tokens(tiny_llama):
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)
    rows = reuse.bench(eng, [2], 24, 8, 1, ["full", "collective"], decode=3)
    assert [r["max_tokens"] for r in rows] == [3, 3]
    assert "round ms (3 tokens)" in reuse.table(rows)
    assert "round prefill ms" in reuse.table(reuse.bench(eng, [2], 24, 8, 1, ["full"]))


def test_vllm_side_helpers(smollm2):
    # SmolLM2: 30 layers, 3 KV heads of 64: K and V, float32
    assert vllm_cpu.kv_bytes_per_token(str(smollm2), "float32") == 2 * 30 * 3 * 64 * 4
    row = dict(agents=2, prompt_tokens=100, max_tokens=1, cold_ms=12.3, cold_cached=0, warm_ms=1.2, warm_cached=96)
    assert vllm_cpu.table([row]).splitlines()[-1] == "| 2 | 1 | 100 | 1 | 12 | 0 | 1 | 96 |"


def test_vllm_side_reads_first_and_second_rounds(tmp_path):
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"2": [[1, 2], [3]], "3": {"before": [[1], [2], [3]], "prompts": [[1, 4]] * 3}}))
    assert vllm_cpu.load_rounds(str(path)) == {2: ([], [[1, 2], [3]]), 3: ([[1], [2], [3]], [[1, 4]] * 3)}


def test_joint_table_takes_medians(tmp_path):
    for r, (ours, cold) in enumerate([(10.0, 40.0), (30.0, 20.0), (20.0, 30.0)], 1):
        (tmp_path / f"ours-d1-n2-r{r}.json").write_text(json.dumps(
            [dict(agents=2, mode=m, max_tokens=1, ms=ours, prompt_tokens=100) for m in reuse.MODES]))
        (tmp_path / f"vllm-n2-r{r}.json").write_text(json.dumps(
            [dict(agents=2, max_tokens=1, cold_ms=cold, warm_ms=1.0, prompt_tokens=100)]))
    out = subprocess.run([sys.executable, str(BENCH / "vllm_table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| 2 | 1 | 1 | 100 | 3 | 20 | 20 | 20 | 20 | 30 | 1 | 0.67x | 0.67x |" in out
    assert "resumed" not in out


def test_joint_table_second_round(tmp_path):
    (tmp_path / "ours-d1-n2-r1.json").write_text(json.dumps(
        [dict(agents=2, mode=m, round=2, max_tokens=1, ms=ms, prompt_tokens=300)
         for m, ms in (("resumed", 10.0), ("without", 25.0))]))
    (tmp_path / "vllm-n2-r1.json").write_text(json.dumps(
        [dict(agents=2, round=2, max_tokens=1, cold_ms=40.0, warm_ms=2.0, prompt_tokens=300)]))
    out = subprocess.run([sys.executable, str(BENCH / "vllm_table.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| resumed ms | without ms | vLLM cold ms | vLLM warm ms | resumed / vLLM cold |" in out
    assert "| 2 | 2 | 1 | 300 | 1 | 10 | 25 | 40 | 2 | 0.25x |" in out
