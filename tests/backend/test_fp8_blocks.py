"""Block-wise FP8 checkpoints (backend/quant.py, backend/place.py, kernels/fp8_block.py): a
scale per bn x bk block of each projection, in both layouts vLLM reads (`fp8` with
`weight_block_size` and `weight_scale_inv`, Qwen3's and DeepSeek's; compressed-tensors'
`block` strategy), placed byte for byte; what is not whole blocks, or not a projection,
widened; what is not supported refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine
from tokendance.backend.parallel import Shard
from tokendance.examples import cli
from tokendance.kernels import fp8_block as fb
from tokendance.kernels.fp8_block import quantize_blocks, spread
from tokendance.kernels.fp8_linear import E4M3, widen

from .test_fp8_checkpoints import rewrite

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def fp8_config(block: list[int]) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": block}


def tensors_config(block: list[int]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "block", "block_structure": block, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block[1],
                                      "dynamic": True}}}}


def blocked(src: Path, dst: Path, block: list[int], layout: str = "fp8", also: tuple[str, ...] = ()) -> Path:
    """`src`'s model with its projections (and names ending in `also`) in e4m3 by blocks,
    as a checkpoint of `layout` stores them; the rest as it was."""
    out = {}
    for k, w in load_file(str(next(src.glob("*.safetensors")))).items():
        if w.dim() >= 2 and (any(f".{p}.weight" in k for p in PROJECTIONS) or k.endswith(also)):
            q, s = zip(*(quantize_blocks(x, *block) for x in w.reshape(-1, *w.shape[-2:])))
            q, s = torch.stack(q).reshape(w.shape), torch.stack(s).reshape(*w.shape[:-2], *s[0].shape)
            out[k], out[k.removesuffix(".weight") + (".weight_scale_inv" if layout == "fp8" else ".weight_scale")] = q, s
        else:
            out[k] = w
    return rewrite(src, dst, out, fp8_config(block) if layout == "fp8" else tensors_config(block))


def eng(folder: Path, **kw) -> Engine:
    return Engine(model=str(folder), dtype="float32", kv_tokens=1024, **kw)


@pytest.mark.parametrize("layout", ["fp8", "compressed-tensors"])
def test_blocks_are_placed_as_stored_and_serve(tiny_llama, tmp_path, layout):
    folder = blocked(tiny_llama, tmp_path / "blocks", [32, 32], layout)
    stored = load_file(str(folder / "model.safetensors"))
    scale = ".weight_scale_inv" if layout == "fp8" else ".weight_scale"
    e = eng(folder)
    attn = e.model.layers[1].self_attn
    assert type(attn.qkv_proj).__name__ == "BlockFp8Linear" and attn.qkv_proj.scale.shape == (4, 2)
    q, k = "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"
    qkv = attn.qkv_proj.weight.cpu().view(torch.uint8)  # on a GPU the engine is there
    assert torch.equal(qkv[:64], stored[f"{q}.weight"].view(torch.uint8))
    assert torch.equal(attn.qkv_proj.scale[:2].cpu(), stored[q + scale])
    assert torch.equal(attn.qkv_proj.scale[2:3].cpu(), stored[k + scale])
    eight = [m for m in e.model.modules() if type(m).__name__ == "BlockFp8Linear"]
    assert len(eight) == 2 * 4  # qkv, o, gate_up, down of 2 layers; the lm_head wide
    # each layer computes the blocks' weights on inputs rounded per group of 32
    torch.manual_seed(0)
    for m in eight:
        x_in = torch.randn(5, m.in_features, device=m.weight.device)
        want = F.linear(x_in, m.wide(torch.float32), m.bias)
        assert (m(x_in) - want).norm() / want.norm() < 0.08
    ids = [e.tokenizer.encode("The debate opens with"), list(range(300, 340))]
    got = e.generate(ids, GREEDY)
    assert all(len(g[0]) == 12 for g in got)
    # the same model in float32 (the blocks widened) picks the same first tokens (the inputs'
    # rounding, 2-3 % a layer, then sends this random model elsewhere, as per-row fp8 does)
    wide = {k: v for k, v in stored.items() if not k.endswith(scale)}
    for k in list(wide):
        if wide[k].dtype == E4M3:
            wide[k] = widen(wide[k]) * spread(stored[k.removesuffix(".weight") + scale], 32, 32, *wide[k].shape)
    want = eng(rewrite(folder, tmp_path / "wide", wide, None)).generate(ids, GREEDY)
    assert [g[0][0] for g in got] == [w[0][0] for w in want]


def test_parts_that_are_not_whole_blocks_widen_their_projection(tiny_llama, tmp_path):
    """Blocks of 64 rows: q's 64 rows are one, k's 32 are not, so the fused qkv is widened
    (q's blocks with it); o (64 rows) stays in blocks."""
    folder = blocked(tiny_llama, tmp_path / "blocks", [64, 32])
    stored = load_file(str(folder / "model.safetensors"))
    model = loader.load(folder, ModelConfig.load(folder), torch.float32, "cpu")
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, nn.Linear) and type(attn.o_proj).__name__ == "BlockFp8Linear"
    for part, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96))):
        name = f"model.layers.0.self_attn.{part}"
        w = stored[f"{name}.weight"]
        assert torch.equal(attn.qkv_proj.weight[rows],
                           widen(w) * spread(stored[f"{name}.weight_scale_inv"], 64, 32, *w.shape))


def test_experts_in_blocks_are_widened_into_their_stacks(make_model, tmp_path):
    src = make_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    folder = blocked(src, tmp_path / "blocks", [32, 32], also=("mlp.gate.weight",))
    stored = load_file(str(folder / "model.safetensors"))
    model = loader.load(folder, ModelConfig.load(folder), torch.float32, "cpu")
    name = "model.layers.1.mlp.experts.2.down_proj"
    w = stored[f"{name}.weight"]
    assert w.dtype == E4M3
    assert torch.equal(model.layers[1].mlp.experts.down_proj[2],
                       widen(w) * spread(stored[f"{name}.weight_scale_inv"], 32, 32, *w.shape))
    router = stored["model.layers.0.mlp.gate.weight"]
    assert torch.equal(model.layers[0].mlp.gate.weight,
                       widen(router) * spread(stored["model.layers.0.mlp.gate.weight_scale_inv"], 32, 32,
                                              *router.shape))


def test_fused_or_turned_tensors_in_blocks_are_widened(make_model, tmp_path):
    """Phi-3 stores q, k, v (and gate, up) fused and turns half of each head: their rows are
    split and reordered across blocks, so they are widened whole (held wide); o and down
    stay in blocks."""
    src = make_model("phi3", partial_rotary_factor=0.5)
    folder = blocked(src, tmp_path / "phi3", [32, 32], also=("qkv_proj.weight", "gate_up_proj.weight"))
    e, wide = eng(folder), eng(src)
    layer = e.model.layers[0]
    assert type(layer.self_attn.o_proj).__name__ == "BlockFp8Linear"
    assert not any(b.dtype == E4M3 for b in layer.self_attn.qkv_proj.buffers())
    assert not any(b.dtype == E4M3 for b in layer.mlp.gate_up_proj.buffers())
    ids = [list(range(500, 530))]
    assert e.generate(ids, GREEDY)[0][0][0] == wide.generate(ids, GREEDY)[0][0][0]


def test_scales_that_are_not_one_per_block_are_refused(tiny_llama, tmp_path):
    folder = blocked(tiny_llama, tmp_path / "blocks", [32, 32])
    tensors = load_file(str(folder / "model.safetensors"))
    o = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    bad = rewrite(folder, tmp_path / "bad", {**tensors, o: torch.ones(2, 1)}, fp8_config([32, 32]))
    with pytest.raises(InvalidRequest, match=r"o_proj's scales have shape \(2, 1\), not one per 32 x 32 block "
                                             r"of \(64, 64\): \(2, 2\)"):
        eng(bad)


def test_a_ranks_share_that_is_not_whole_blocks_is_widened_then_shared(tiny_llama, tmp_path):
    """Blocks of 32 over two ranks (rank 1 here, loaded alone): o's 64 columns split into
    whole blocks (rank 1 takes the second column of scales); k's 32 rows would split into
    half blocks, so k is widened whole and its rows shared out wide, and the fused qkv it
    lands in is held wide (q's whole blocks widened with it)."""
    folder = blocked(tiny_llama, tmp_path / "blocks", [32, 32])
    stored = load_file(str(folder / "model.safetensors"))
    rank = Shard(rank=1, size=2, device=torch.device("cpu"), group=None, calls=None)
    model = loader.load(folder, ModelConfig.load(folder), torch.float32, "cpu", tp=rank)
    attn, o, k = model.layers[0].self_attn, "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.k_proj"
    assert type(attn.o_proj).__name__ == "BlockFp8Linear"
    assert torch.equal(attn.o_proj.scale, stored[f"{o}.weight_scale_inv"][:, 1:])
    assert torch.equal(attn.o_proj.weight.view(torch.uint8), stored[f"{o}.weight"].view(torch.uint8)[:, 32:])
    assert isinstance(attn.qkv_proj, nn.Linear)
    w = stored[f"{k}.weight"]
    assert torch.equal(attn.qkv_proj.weight[32:48], (widen(w) * spread(stored[f"{k}.weight_scale_inv"], 32, 32,
                                                                        *w.shape))[16:])


def test_the_writer_writes_blocks_as_llm_compressor_does(tiny_llama, tmp_path, capsys):
    """`tokendance quantize --block`: the same bytes, scales and config as a checkpoint of
    compressed-tensors' block strategy; served by the same layers."""
    out = tmp_path / "written"
    assert cli.main(["quantize", str(tiny_llama), str(out), "--block", "32,32"]) == 0
    assert "14 projections in e4m3 in 32 x 32 blocks" in capsys.readouterr().out
    want = blocked(tiny_llama, tmp_path / "by-hand", [32, 32], "compressed-tensors")
    got, ref = load_file(str(out / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert got.keys() == ref.keys() and all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8))
                                            if got[k].dtype == E4M3 else torch.equal(got[k], ref[k]) for k in got)
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    for part, fields in tensors_config([32, 32])["config_groups"]["group_0"].items():  # what the loader reads
        assert fields == group[part] or fields.items() <= group[part].items(), part
    ids = [list(range(300, 340))]
    assert eng(out).generate(ids, GREEDY) == eng(want).generate(ids, GREEDY)
    # one size for both sides; sizes the loader would refuse, refused here; no whole blocks
    assert cli.main(["quantize", str(tiny_llama), str(tmp_path / "square"), "--block", "16"]) == 0
    assert "in 16 x 16 blocks" in capsys.readouterr().out
    for bad in ("48,32", "8", "a,b", "32,32,32"):
        assert cli.main(["quantize", str(tiny_llama), str(tmp_path / "bad"), "--block", bad]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--block {bad}: two powers of two of 16 or more" in err
    assert cli.main(["quantize", str(tiny_llama), str(tmp_path / "none"), "--block", "128,128"]) == 1
    assert "is whole blocks of 128 x 128" in capsys.readouterr().err and not (tmp_path / "none").exists()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("rows", [3, 16, 17, 64, 65, 130])
def test_the_gpu_layer_is_the_reference(rows: int):
    """A decode step's rows (the Triton product, K split), up to MID_ROWS (tiles of 64 rows)
    and a prefill's (torch's block-scaled product where it takes them, the rows padded to a
    multiple of 4; taken or not, it is tried at each count), with a bias."""
    torch.manual_seed(0)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w8, ws = quantize_blocks(torch.randn(384, 512, device="cuda") / 512**0.5, 128, 128)
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    want = fb.block_linear_reference(x.float(), w8, ws, (128, 128), bias.float())
    got = fb.block_linear(x, w8, ws, (128, 128), bias)
    assert got.dtype == torch.bfloat16 and (got.float() - want).norm() / want.norm() < 1e-2
    if (cub := fb.cublas(x, w8, ws, (128, 128), bias)) is not None:
        assert (cub.float() - want).norm() / want.norm() < 1e-2
