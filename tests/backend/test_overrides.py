"""vLLM's --hf-overrides: fields set over config.json before the engine reads it (YaRN
over a model that has none, as Qwen advises for long contexts); the model then computes
what HF computes on a config.json written so; a value that cannot be read names the
override."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine
from tokendance.backend.overrides import overridden
from tokendance.examples import cli

from .test_gemma2 import hf_logprobs, scoring
from .test_greedy_vs_hf import prompts_for

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
LONGER = {"rope_scaling": YARN, "max_position_embeddings": 2048}


def test_each_field_is_replaced_whole_and_rope_by_either_name():
    file = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "sliding_window": 24, "x": 1}
    assert overridden(file, {"rope_scaling": YARN, "sliding_window": None}) == {
        "rope_scaling": {"rope_theta": 1e6, **YARN}, "sliding_window": None, "x": 1}  # the file's theta kept
    assert overridden(file, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}) == {
        **file, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}
    assert overridden(file, {"rope_theta": 5e5})["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    old = {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e4}  # before transformers 5
    assert overridden(old, {"rope_parameters": YARN}) == {"rope_parameters": YARN, "rope_theta": 1e4}
    assert overridden(file, {}) == file


def test_yarn_over_a_model_without_it_is_what_hf_computes(make_model, tmp_path):
    folder = make_model("qwen2", vocab_size=2048, max_position_embeddings=512)
    want = tmp_path / "yarn"  # the same weights, config.json written with the override
    shutil.copytree(folder, want)
    raw = json.loads((folder / "config.json").read_text())
    theta = raw["rope_parameters"]["rope_theta"]
    raw.update(rope_parameters={**YARN, "rope_theta": theta}, max_position_embeddings=2048)
    (want / "config.json").write_text(json.dumps(raw))
    kw = dict(dtype="float32", kv_tokens=4096, max_batched_tokens=256)
    eng, plain = Engine(model=str(folder), hf_overrides=LONGER, **kw), Engine(model=str(folder), **kw)
    assert eng.mcfg == ModelConfig.load(want) and (eng.max_model_len, plain.max_model_len) == (2048, 512)
    assert eng.mcfg.rope["rope_type"] == "yarn" and eng.mcfg.rope["rope_theta"] == theta
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32).eval()
    prompts = prompts_for(2048, (40, 600), seed=7)  # one past the original 512 positions
    toks, lps = scoring(eng, prompts, 4)
    for t, lp in zip(toks, lps):
        assert lp == pytest.approx(hf_logprobs(hf, t), abs=1e-4)
    _, short = scoring(plain, prompts[:1], 4)
    assert max(abs(a - b) for a, b in zip(short[0], lps[0])) > 1e-3  # YaRN changed the model


def test_a_value_that_cannot_be_read_names_the_override(tiny_llama, capsys):
    with pytest.raises(InvalidRequest, match=r"config.json under --hf-overrides \{\"head_dim\": 0\}: "
                                             "head_dim must be positive integers") as e:
        Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, hf_overrides={"head_dim": 0})
    assert "\n" not in str(e.value)
    assert cli.main(["engine", "--model", str(tiny_llama), "--hf-overrides", '{"num_hidden_layers": 0}']) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokendance engine: ") and "num_hidden_layers must be positive integers" in err
    assert "\n" not in err
    with pytest.raises(SystemExit) as stop:
        cli.main(["engine", "--hf-overrides", "[1]"])
    assert stop.value.code == 2 and "--hf-overrides: expected a JSON object" in capsys.readouterr().err
