"""`tokendance quantize`: a wide checkpoint written again with 8-bit float projections, in
compressed-tensors' FP8-dynamic layout (the one llm-compressor writes for vLLM; this engine
reads it as it is, backend/quant.py): each projection's weight in e4m3 under a float32
scale per output row, as `--quantization fp8` rounds it on loading, inputs rounded per
token at run time. Half a bf16 checkpoint's projection bytes on disk and on loading;
nothing to calibrate.

With `--block BN,BK` each projection takes a scale per BN x BK block instead (the layout
of Qwen3's and DeepSeek's FP8 checkpoints, in llm-compressor's FP8_BLOCK form: inputs
rounded per group of BK columns at run time, kernels/fp8_block.py).

Projections are those the model holds in 8 bits under `--quantization fp8` (the layers' q,
k, v, o, gate, up and down whose fused widths divide by 16: backend/quant.py `linear`; with
blocks, those whose fused widths are whole blocks), asked of the model itself; every other
linear weight (lm_head, routers, the experts) stays wide and is listed in the config's
`ignore`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.model import Decoder
from tokendance.backend.quant import Quant, block_side
from tokendance.backend.start import drawing
from tokendance.kernels.fp8_block import quantize_blocks
from tokendance.kernels.fp8_linear import E4M3, quantize_rows

SHARD_BYTES = 4 << 30  # a safetensors file's weights at most, as transformers shards


def scheme(block: tuple[int, int] | None) -> dict:
    """The quantization_config written: compressed-tensors' 8-bit floats, weights per row
    (channel) or per block, inputs per token or per group of a block's columns, dynamic."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    weights, inputs = ({**fp8, "strategy": "channel", "dynamic": False}, {**fp8, "strategy": "token", "dynamic": True})
    if block is not None:
        weights = {**fp8, "strategy": "block", "block_structure": list(block), "dynamic": False}
        inputs = {**fp8, "strategy": "group", "group_size": block[1], "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None, "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
                "weights": weights, "input_activations": inputs}}}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write a model again with 8-bit float projections")
    p.add_argument("model", help="an HF folder, a .gguf or a hub id in the Hugging Face cache ('default': "
                                 "the embedded SmolLM2-135M-Instruct)")
    p.add_argument("out", help="the new model's folder (must not exist, or be empty)")
    p.add_argument("--revision", default=None, help="the hub model's branch, tag or commit")
    p.add_argument("--download-dir", default=None, metavar="DIR", help="the Hugging Face cache to look in")
    p.add_argument("--block", default=None, metavar="BN,BK",
                   help="a scale per block of BN rows x BK columns (as 128,128: Qwen3's and DeepSeek's FP8 "
                        "layout), not per row")


def main(args: argparse.Namespace) -> int:
    block = blocks(args.block)
    out = Path(args.out)
    _empty(out)  # before the model is found (a .gguf's conversion takes a while)
    wrote = write(loader.resolve(args.model, args.revision, args.download_dir), out, block)
    print(f"wrote {args.out}: {wrote['projections']} projections in e4m3"
          f"{f' in {block[0]} x {block[1]} blocks' if block else ''}, weights "
          f"{wrote['bytes'] / 2**20:,.1f} MiB (from {wrote['wide_bytes'] / 2**20:,.1f})")
    return 0


def blocks(given: str | None) -> tuple[int, int] | None:
    """--block's BN,BK (or one size for both): two sides the loader takes (`block_side`)."""
    if given is None:
        return None
    try:
        sizes = [int(v) for v in given.split(",")]
    except ValueError:
        sizes = []
    sizes = sizes * 2 if len(sizes) == 1 else sizes
    if len(sizes) != 2 or not all(block_side(v) for v in sizes):
        raise InvalidRequest(f"--block {given}: two powers of two of 16 or more, as 128,128", "block")
    return sizes[0], sizes[1]


def write(src: Path, out: Path, block: tuple[int, int] | None = None) -> dict[str, int]:
    """`src`'s model at `out` with its projections in e4m3, a scale per row or per `block`
    (atomic: a failure leaves no folder); how many projections, and the weights' bytes
    after and before."""
    cfg = ModelConfig.load(src)  # a model this engine serves (InvalidRequest in one line otherwise)
    raw = json.loads((src / "config.json").read_text())
    if q := raw.get("quantization_config"):
        raise InvalidRequest(f"{src} is quantized already ({q.get('quant_method') if isinstance(q, dict) else q})",
                             "model")
    _empty(out)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no .safetensors weights in {src}", "model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        count, ignore, sizes = _weights(files, tmp, eight_bit(cfg, block), block)
        if count == 0:
            raise InvalidRequest(f"no projection of {src} is whole blocks of {block[0]} x {block[1]}"
                                 if block else f"no projection of {src} can be held in 8 bits", "model")
        raw["quantization_config"] = {**scheme(block), "ignore": sorted(ignore | {"lm_head"})}
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"projections": count, "bytes": sizes[0], "wide_bytes": sizes[1]}


def _empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidRequest(f"{out} exists and is not an empty folder", "out")


def eight_bit(cfg: ModelConfig, block: tuple[int, int] | None = None) -> Callable[[str], bool]:
    """Whether a checkpoint tensor's rows land in a projection `--quantization fp8` holds in
    8 bits (with `block`, one a block-wise checkpoint holds in 8 bits): asked of the model
    (built on the meta device, no memory)."""
    quant = Quant("fp8", False) if block is None else Quant("compressed-tensors", True, False, block)
    with torch.device("meta"), drawing(False):
        model = Decoder(replace(cfg, quant=quant))
    eight = {name for name, b in model.named_buffers() if b.dtype == E4M3}
    return lambda key: loader.target(key, cfg)[0] in eight


def _weights(files: list[Path], to: Path, eight: Callable[[str], bool],
             block: tuple[int, int] | None) -> tuple[int, set[str], tuple[int, int]]:
    """Every tensor of `files` into shards under `to` (each written when full), those `eight`
    takes rounded, per row or per `block`; (how many were, the linear modules kept wide,
    (bytes written, bytes read))."""
    shard: dict[str, torch.Tensor] = {}
    names: list[str] = []
    where: dict[str, int] = {}
    count, ignore, written, read, held = 0, set(), 0, 0, 0

    def flush() -> None:
        names.append(f"part-{len(names)}.safetensors")
        save_file({k: t.contiguous() for k, t in shard.items()}, str(to / names[-1]), metadata={"format": "pt"})
        where.update((k, len(names) - 1) for k in shard)
        shard.clear()

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                w = f.get_tensor(key)
                read += w.nbytes
                new = {key: w}
                if w.dim() == 2 and eight(key):
                    q, s = quantize_rows(w) if block is None else quantize_blocks(w, *block)
                    new = {key: q, key.removesuffix(".weight") + ".weight_scale": s}
                    count += 1
                elif w.dim() == 2 and key.endswith(".weight") and "embed" not in key:
                    ignore.add(key.removesuffix(".weight"))  # a linear module of another kind, wide
                size = sum(t.nbytes for t in new.values())
                if shard and held + size > SHARD_BYTES:
                    flush()
                    held = 0
                shard.update(new)
                written, held = written + size, held + size
    flush()
    final = ["model.safetensors"] if len(names) == 1 else [
        f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for old, new in zip(names, final):
        os.replace(to / old, to / new)
    if len(final) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": {k: final[i] for k, i in where.items()}}
        (to / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return count, ignore, (written, read)
