"""Tensor parallelism over 8-bit weights on the CPU (gloo): `--quantization fp8`, a stored
FP8 checkpoint and a block-wise one, two ranks against one process."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tokendance.examples import cli
from tests.backend.test_idle import run
from tests.backend.test_parallel import engine
from tests.backend.test_reuse import round_prompts


def test_two_ranks_serve_fp8_weights(tiny_llama):
    """--quantization fp8 over two ranks: each rounds its share of each projection, and the
    row-parallel ones' rows (o_proj, down_proj: their inputs split) take their shard's
    scales, so one process's tokens are not promised (here all of them were, when this was
    written); the ranks agree with each other."""
    two = engine(tiny_llama, quantization="fp8", tensor_parallel_size=2)
    try:
        e4m3 = [m for m in two.model.modules()
                if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype == torch.float8_e4m3fn]
        assert len(e4m3) == 4 * two.mcfg.num_layers
        prompts, spans = round_prompts(3, seed=5)
        got, _ = run(two, prompts, spans, "collective", "c-")
    finally:
        two.close()
    assert two.tp.agreed
    want, _ = run(engine(tiny_llama, quantization="fp8"), prompts, spans, "collective", "c-")
    assert sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) >= 0.9 * sum(len(x) for x in want)


def test_two_ranks_serve_an_fp8_checkpoint(tiny_llama, tmp_path):
    """A checkpoint stored in e4m3 (`tokendance quantize`) over two ranks: a column-parallel
    projection takes its rows' bytes and scales, a row-parallel one its columns' bytes under
    the whole rows' scales (nothing rounded again); the ranks agree, and with one process on
    90 % of the tokens at least (each rank rounds its share of o's and down's inputs)."""
    folder = tmp_path / "fp8"
    assert cli.main(["quantize", str(tiny_llama), str(folder)]) == 0
    stored = load_file(str(folder / "model.safetensors"))

    def check(model) -> None:
        attn, o, k = model.layers[1].self_attn, "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.k_proj"
        assert torch.equal(attn.o_proj.scale, stored[f"{o}.weight_scale"])
        assert torch.equal(attn.o_proj.weight.view(torch.uint8), stored[f"{o}.weight"].view(torch.uint8)[:, :32])
        assert torch.equal(attn.qkv_proj.scale[32:48], stored[f"{k}.weight_scale"][:16])  # q's 32 rows, then k's 16

    got, want = two_and_one(folder, check)
    assert sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) >= 0.9 * sum(len(x) for x in want)


def test_two_ranks_serve_a_block_wise_fp8_checkpoint(tiny_llama, tmp_path):
    """Blocks of 16 x 16 over two ranks: each share of a projection is whole blocks, so its
    scales split as its bytes do (a row-parallel one's columns, too), and each input group
    lies in one rank's columns, rounded as one process rounds it: the tokens are one
    process's."""
    from tests.backend.test_fp8_blocks import blocked

    folder = blocked(tiny_llama, tmp_path / "blocks", [16, 16])
    stored = load_file(str(folder / "model.safetensors"))

    def check(model) -> None:
        attn, o, k = model.layers[1].self_attn, "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.k_proj"
        assert type(attn.o_proj).__name__ == "BlockFp8Linear"
        assert torch.equal(attn.o_proj.scale, stored[f"{o}.weight_scale_inv"][:, :2])  # 32 of 64 columns
        assert torch.equal(attn.o_proj.weight.view(torch.uint8), stored[f"{o}.weight"].view(torch.uint8)[:, :32])
        assert torch.equal(attn.qkv_proj.scale[2:3], stored[f"{k}.weight_scale_inv"][:1])  # q's 32 rows, then k's 16

    got, want = two_and_one(folder, check)
    assert got == want  # only the sums' order differs from one process's


def two_and_one(folder, check) -> tuple[list, list]:
    """A collective round's tokens over two ranks (after `check` of the leader's model) and
    in one process; the ranks must agree."""
    two = engine(folder, tensor_parallel_size=2)
    try:
        check(two.model)
        prompts, spans = round_prompts(3, seed=5)
        got, _ = run(two, prompts, spans, "collective", "c-")
    finally:
        two.close()
    assert two.tp.agreed
    return got, run(engine(folder), prompts, spans, "collective", "c-")[0]
