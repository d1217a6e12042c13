"""Checkpoints stored in 8-bit floats (backend/quant.py, backend/place.py) and the writer of
one (`tokendance quantize`, backend/checkpoint.py): placed byte for byte, served as
`--quantization fp8` serves the wide model, and what is not supported refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine
from tokendance.examples import cli
from tokendance.kernels.fp8_linear import E4M3, fp8_linear_reference, quantize_rows, widen

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def eng(folder: Path, **kw) -> Engine:
    return Engine(model=str(folder), dtype="float32", kv_tokens=1024, **kw)


def projections(e: Engine) -> dict[str, torch.Tensor]:
    """Every 8-bit projection's bytes and scales, by name."""
    return {k: v.view(torch.uint8) if v.dtype == E4M3 else v for k, v in e.model.named_buffers()
            if k.endswith((".weight", ".scale", ".input_scale"))}


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    """`src`'s folder at `dst` with these weights and this quantization_config."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    raw.pop("quantization_config", None)
    if quantization is not None:
        raw["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory) -> Path:
    return Path(cli_quantize(tiny_llama, tmp_path_factory.mktemp("fp8") / "llama-fp8"))


def cli_quantize(src: Path, out: Path) -> Path:
    assert cli.main(["quantize", str(src), str(out)]) == 0
    return out


def test_a_written_checkpoint_serves_as_the_flag_serves_the_wide_one(written, tiny_llama):
    raw = json.loads((written / "config.json").read_text())["quantization_config"]
    assert raw["quant_method"] == "compressed-tensors" and raw["ignore"] == ["lm_head"]
    stored = load_file(str(written / "model.safetensors"))
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == E4M3
    assert stored["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert stored["model.embed_tokens.weight"].dtype == torch.float32  # the rest as it was
    a, b = eng(written), eng(tiny_llama, quantization="fp8")
    got, want = projections(a), projections(b)
    assert got.keys() == want.keys() and len(got) == 2 * 4 * 2  # weight and scale of 4 projections, 2 layers
    assert all(torch.equal(got[k], want[k]) for k in got)
    ids = [a.tokenizer.encode("The debate opens with"), list(range(300, 340))]
    assert a.generate(ids, GREEDY) == b.generate(ids, GREEDY)
    # the flag may name the checkpoint's method, not another
    assert len(projections(eng(written, quantization="compressed-tensors"))) == 16
    with pytest.raises(InvalidRequest, match="--quantization fp8, but .*config.json says compressed-tensors"):
        eng(written, quantization="fp8")


def test_the_writer_refuses_in_one_line(written, tmp_path, capsys):
    assert cli.main(["quantize", str(written), str(tmp_path / "again")]) == 1
    assert "is quantized already (compressed-tensors)" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli.main(["quantize", "default", str(tmp_path / "full")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not an empty folder" in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half written left


@pytest.mark.parametrize("arch, over", [("phi3", {"partial_rotary_factor": 0.5}), ("qwen2", {}),
                                        ("llama", {"head_dim": 8, "num_key_value_heads": 1})])
def test_fused_turned_and_biased_projections(make_model, tmp_path, arch, over):
    """Phi-3 stores q, k, v (and gate, up) fused, and turns half of each head: the loader
    splits and reorders rows, bytes and scales alike; the same bytes as rounding the wide
    rows after the reorder (rounding a row does not care where it sits). Qwen2's q, k and
    v have biases, wide beside their 8-bit weights. The writer rounds what the model holds
    in 8 bits: a k of 8 rows too, whose fused qkv (48 rows) the tensor cores take."""
    src = make_model(arch, **over)
    out = cli_quantize(src, tmp_path / "fp8")
    assert load_file(str(out / "model.safetensors"))["model.layers.1.self_attn.o_proj.weight"].dtype == E4M3
    if arch == "llama":
        assert load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"].shape == (8, 64)
        assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    a, b = eng(out), eng(src, quantization="fp8")
    biases = [m.bias for m in a.model.modules() if type(m).__name__ == "Fp8Linear" and m.bias is not None]
    assert len(biases) == (2 if arch == "qwen2" else 0)
    assert all(torch.equal(x.bias, y.bias) for x, y in zip(a.model.modules(), b.model.modules())
               if type(x).__name__ == "Fp8Linear" and x.bias is not None)
    got, want = projections(a), projections(b)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    ids = [list(range(500, 530))]
    assert a.generate(ids, GREEDY) == b.generate(ids, GREEDY)


def per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax() / 448.0
    return (w / s).clamp(-448, 448).to(E4M3), s.reshape(1)


def test_static_input_scales_and_scales_per_tensor(tiny_llama, tmp_path):
    """vLLM's `fp8` (AutoFP8's): one scale per weight, inputs under a calibrated scale.
    q, k and v read one input: it takes the largest of their three."""
    wide = load_file(str(next(tiny_llama.glob("*.safetensors"))))
    tensors, inputs = {}, {}
    for k, w in wide.items():
        if k.endswith("_proj.weight"):
            stem = k.removesuffix(".weight")
            tensors[k], tensors[f"{stem}.weight_scale"] = per_tensor(w)
            inputs[stem] = torch.tensor([0.01 + 0.001 * len(inputs)])
            tensors[f"{stem}.input_scale"] = inputs[stem]
        else:
            tensors[k] = w
    folder = rewrite(tiny_llama, tmp_path / "static", tensors,
                     {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})
    e = eng(folder)
    qkv = e.model.layers[1].self_attn.qkv_proj
    largest = max(inputs[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv")
    assert torch.equal(qkv.input_scale.reshape(1).cpu(), largest)
    q_wide = widen(tensors["model.layers.1.self_attn.q_proj.weight"]) * tensors["model.layers.1.self_attn.q_proj.weight_scale"]
    assert torch.equal(qkv.wide(torch.float32)[:64].cpu(), q_wide)
    x = torch.randn(3, 64, device=qkv.weight.device)  # the engine's device (a GPU's in bench/h200.sh)
    got = qkv(x)
    assert torch.equal(got, fp8_linear_reference(x, qkv.weight, qkv.scale, None, largest.to(x.device)))
    assert not torch.equal(got, fp8_linear_reference(x, qkv.weight, qkv.scale))  # not rounded per row
    assert len(e.generate([list(range(100, 120))], GREEDY)[0][0]) == 12
    del tensors["model.layers.0.mlp.down_proj.input_scale"]
    with pytest.raises(InvalidRequest, match="holds no model.layers.0.mlp.down_proj.input_scale"):
        eng(rewrite(tiny_llama, tmp_path / "no-input", tensors,
                    {"quant_method": "fp8", "activation_scheme": "static"}))


def test_what_the_checkpoint_keeps_wide_stays_wide(written, tiny_llama, tmp_path):
    """Layer 1's q stored wide (compressed-tensors' ignore list), its k and v in e4m3: the
    projection is held wide, its k and v rows widened; an e4m3 weight of what the model
    never holds in 8 bits (the lm_head here) is widened too."""
    wide = load_file(str(next(tiny_llama.glob("*.safetensors"))))
    tensors = load_file(str(written / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj"
    tensors[f"{q}.weight"] = wide[f"{q}.weight"]
    del tensors[f"{q}.weight_scale"]
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = quantize_rows(wide["lm_head.weight"])
    config = json.loads((written / "config.json").read_text())["quantization_config"]
    folder = rewrite(written, tmp_path / "mixed", tensors, {**config, "ignore": [q]})
    model = loader.load(folder, ModelConfig.load(folder), torch.float32, "cpu")  # the engine would pack it
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, nn.Linear) and type(model.layers[0].self_attn.qkv_proj).__name__ == "Fp8Linear"
    k = "model.layers.1.self_attn.k_proj"
    assert torch.equal(qkv.weight[:64], wide[f"{q}.weight"])
    assert torch.equal(qkv.weight[64:96], widen(tensors[f"{k}.weight"]) * tensors[f"{k}.weight_scale"])
    assert torch.equal(model.lm_head.weight, widen(tensors["lm_head.weight"]) * tensors["lm_head.weight_scale"])
    assert len(eng(folder).generate([list(range(100, 120))], GREEDY)[0][0]) == 12


def test_experts_in_e4m3_are_widened_into_their_stacks(make_model, tmp_path):
    moe = make_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    out = cli_quantize(moe, tmp_path / "moe-fp8")
    tensors = load_file(str(out / "model.safetensors"))
    up = "model.layers.0.mlp.experts.2.up_proj"
    tensors[f"{up}.weight"], tensors[f"{up}.weight_scale"] = quantize_rows(tensors[f"{up}.weight"])
    e = eng(rewrite(out, tmp_path / "moe-experts", tensors, json.loads((out / "config.json").read_text())
                    ["quantization_config"]))
    stacked = e.model.layers[0].mlp.experts.gate_up_proj[2].cpu()
    assert torch.equal(stacked[32:], widen(tensors[f"{up}.weight"]) * tensors[f"{up}.weight_scale"])
    assert len(e.generate([list(range(100, 120))], GREEDY)[0][0]) == 12


DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def group(weights: dict | None = None, inputs: dict | None = DYNAMIC, **kw) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, **(weights or {})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": inputs}}, **kw}


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8", "weight_block_size": [100, 128]}, r"weight_block_size \[100, 128\] \(blocks of two"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "block-wise weights with static input scales"),
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
    (group(inputs=None), "8-bit weights with wide inputs"),
    (group({"type": "int"}), "8-bit int weights"),
    (group({"strategy": "block", "block_structure": [128, 128]}), "block-wise weights with input scales per token"),
    (group({"strategy": "block", "block_structure": [128, 128]}, {**DYNAMIC, "strategy": "group", "group_size": 64}),
     r"per group \(group_size 64\)"),
    (group({"strategy": "group"}), "weight scales per group"),
    (group(format="pack-quantized"), "format 'pack-quantized'"),
    ({**group(), "config_groups": {"group_0": {"weights": [8], "input_activations": DYNAMIC}}},
     "group group_0: format 'float-quantized', None-bit None weights"),
    (group(inputs={**DYNAMIC, "strategy": "group"}), "input scales per group"),
    ({**group(), "config_groups": {"a": group()["config_groups"]["group_0"], "b": {
        **group()["config_groups"]["group_0"], "input_activations": {**DYNAMIC, "strategy": "tensor",
                                                                     "dynamic": False}}}},
     r"groups of different schemes together \(dynamic, static\)"),
])
def test_quantizations_we_do_not_serve_are_refused_by_name(written, tmp_path, config, message):
    folder = rewrite(written, tmp_path / "refused", load_file(str(written / "model.safetensors")), config)
    with pytest.raises(InvalidRequest, match=message):
        eng(folder)


def test_scales_that_do_not_fit_are_refused(written, tmp_path):
    tensors = load_file(str(written / "model.safetensors"))
    config = json.loads((written / "config.json").read_text())["quantization_config"]
    o = "model.layers.0.self_attn.o_proj.weight_scale"
    bad = {**tensors, o: torch.ones(1, 1, 1, 4)}  # 4 of a 64 x 64 weight: block-wise
    with pytest.raises(InvalidRequest, match="o_proj.weight_scale has shape .*block-wise scales are not supported"):
        eng(rewrite(written, tmp_path / "blocks", bad, config))
    q = "model.layers.1.self_attn.q_proj"
    with pytest.raises(InvalidRequest, match=r"q_proj.input_scale has shape \(2,\): a static input scale is one"):
        eng(rewrite(written, tmp_path / "inputs", {**tensors, f"{q}.input_scale": torch.ones(2)}, config))
    with pytest.raises(InvalidRequest, match="o_proj.weight in model.safetensors: in e4m3, but the checkpoint holds no"):
        eng(rewrite(written, tmp_path / "no-scale", {k: v for k, v in tensors.items() if k != o}, config))
    with pytest.raises(InvalidRequest, match="compressed-tensors needs a checkpoint quantized so"):
        eng(rewrite(written, tmp_path / "wide", {}, None), quantization="compressed-tensors")


def test_a_checkpoint_written_in_shards_loads_alike(written, tiny_llama, tmp_path, monkeypatch):
    """Shards of at most 64 KiB here (4 GiB as written): an index names each tensor's file,
    and the model they make holds the one file's bytes."""
    from tokendance.backend import checkpoint

    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 64 << 10)
    out = cli_quantize(tiny_llama, tmp_path / "sharded")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index.values()) == set(files) and len(index) == len(load_file(str(written / "model.safetensors")))
    got, want = projections(eng(out)), projections(eng(written))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
