"""Configuration: the engine's (EngineConfig) and the model's (ModelConfig, read from an
HF folder's config.json; what only some families' configs hold is read in
backend/families.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tokendance.backend import families, quant
from tokendance.backend.api import BASES, KV_DTYPES, POLICIES, QUANTIZATIONS, REUSE_DEFAULTS, InvalidRequest
from tokendance.backend.overrides import named, overridden
from tokendance.backend.quant import Quant
from tokendance.kernels.fp8 import FP8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# config.json fields without a default, and the other counts (positive integers all)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
COUNTS = (*REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings")


def top_logprobs(max_logprobs: int, vocab: int) -> int:
    """The alternatives a token's logprobs may list under --max-logprobs (-1: any) over a
    vocabulary of `vocab`."""
    return vocab if max_logprobs < 0 else min(max_logprobs, vocab)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf, a hub id in the HF cache, or None for the embedded default
    tokenizer: str | None = None  # vLLM's --tokenizer: a folder's (or hub id's) instead of the model's own
    hf_config_path: str | None = None  # vLLM's: a folder's (or hub id's) config.json instead of the model's own
    # vLLM's: a hub id's branch, tag or commit (None: main); the tokenizer's (None: revision's);
    # the hub cache they are found in (None: huggingface_hub's; backend/hub.py)
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)  # vLLM's: fields set over config.json
    trust_remote_code: bool = False  # vLLM's: a tokenizer whose class is code in its folder may load
    max_logprobs: int = 20  # vLLM's: the alternatives a token's logprobs may list (-1: any)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # vLLM's: the pool's K/V in the model's dtype, or fp8 (kernels/fp8.py)
    quantization: str | None = None  # vLLM's: fp8 or compressed-tensors (backend/quant.py)
    device: str = "auto"  # with tensor parallelism, the first of its devices
    tensor_parallel_size: int = 1  # processes (on CUDA, GPUs) that split each layer (backend/parallel.py)
    block_size: int = 16  # vLLM's --block-size: tokens a pool block holds
    kv_tokens: int = 0  # pool size in tokens; 0: 16k on CPU, on CUDA as gpu_memory_utilization says
    # vLLM's: the share of the GPU's memory this engine holds, weights, a step's peak and the
    # pool together (backend/budget.py); 0: the pool takes 85 % of what the weights leave free
    gpu_memory_utilization: float = 0.0
    # vLLM's other sizes of the pool: in bytes, or in blocks (its --num-gpu-blocks-override)
    kv_cache_memory_bytes: int = 0
    num_gpu_blocks_override: int = 0
    max_seqs: int = 256
    scheduling_policy: str = "fcfs"  # vLLM's: or "priority", by each request's priority (backend/scheduler.py)
    max_batched_tokens: int = 0  # per step; 0: 2048 on CPU, 16384 on CUDA
    max_model_len: int = 0  # 0: the model's limit (capped by the pool)
    seed: int = 0
    random_weights: bool = False  # vLLM's --load-format dummy, for timing: config.json and a tokenizer suffice
    cuda_graphs: int = 128  # on CUDA, replay decode steps of up to this many sequences; 0: off
    check_layer: int = 1  # pic / collective: where deviating tokens are selected
    # pic / collective: share of reused tokens recomputed, at most; of those, only tokens
    # deviating above the floor; where a shared segment's base KV comes from (BASES)
    recompute_ratio: float = REUSE_DEFAULTS["recompute_ratio"]
    recompute_floor: float = REUSE_DEFAULTS["recompute_floor"]
    bases: str = REUSE_DEFAULTS["bases"]
    # pic / collective: a shared segment shorter than this is computed as the request's own
    # tokens; None: 64 on CUDA (32-token segments made a round slower there), 0 on CPU
    min_shared_tokens: int | None = REUSE_DEFAULTS["min_shared_tokens"]
    segment_cache_fraction: float = 0.25  # of the pool, for shared segments' base KV
    anchor_bytes: int = 1 << 30  # kvcomm / kvcmas: their anchors' memory, on the pool's device (backend/anchors.py)
    anchor_rank: int = 32  # kvcmas: the rank its anchors are held at (KVCMAS's default; backend/lowrank.py)
    offload_bytes: int | None = None  # host memory for idle agents' KV (backend/idle.py); 0: off,
    # None: device.host_tier_bytes (8 GiB beside a GPU, 1 GiB on a CPU)
    overlap: bool | None = None  # decode steps overlap host and GPU (backend/lookahead.py); None: on CUDA
    # vLLM's: n-gram speculation, {"method": "ngram", "num_speculative_tokens": k, ...}
    # (backend/speculate.py, backend/ngram.py); None: off
    speculative_config: dict[str, Any] | None = None
    # the default sampling (backend/generation.py): "auto" (the generation_config.json beside
    # the model's config.json), "vllm" (none) or a folder; values set over it
    generation_config: str = "auto"
    override_generation_config: dict[str, float] = field(default_factory=dict)

    def dtype_on(self, device: torch.device) -> torch.dtype:
        """The weights' and the KV's dtype on `device` (InvalidRequest for a choice outside
        its set: the dtype, the bases, the scheduling policy)."""
        if self.bases not in BASES:
            raise InvalidRequest(f"unknown bases {self.bases!r}; choose one of {', '.join(BASES)}", "bases")
        if self.scheduling_policy not in POLICIES:
            raise InvalidRequest(f"unknown scheduling policy {self.scheduling_policy!r}; choose one of "
                                 f"{', '.join(POLICIES)}", "scheduling_policy")
        if self.block_size < 1:
            raise InvalidRequest(f"block_size must be at least 1, not {self.block_size}", "block_size")
        if self.max_logprobs < -1:
            raise InvalidRequest("max_logprobs must be -1 (any) or at least 0", "max_logprobs")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise InvalidRequest(f"unsupported quantization {self.quantization!r}; choose one of "
                                 f"{', '.join(QUANTIZATIONS)}", "quantization")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise InvalidRequest(f"unsupported kv cache dtype {self.kv_cache_dtype!r}; choose one of "
                                 f"{', '.join(KV_DTYPES)}", "kv_cache_dtype")
        name = self.dtype if self.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        if name not in DTYPES:
            raise InvalidRequest(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}", "dtype")
        return DTYPES[name]

    def kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The pool's dtype beside weights of `dtype`."""
        return dtype if self.kv_cache_dtype == "auto" else FP8[self.kv_cache_dtype]


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    # RMSNorm of q and k before RoPE: "head" (Qwen3: each head's) or "all" (OLMo 2: the whole
    # projections, every head at once); None: none
    qk_norm: str | None = None
    post_norm: bool = False  # OLMo 2: each block's output normed before its residual add, no input norms
    sandwich: bool = False  # Gemma 3: norms before and after both attention and MLP
    norm_offset: bool = False  # Gemma's norms scale by 1 + weight, in float32
    act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma's)
    logit_softcap: float | None = None  # Gemma's final logits: cap * tanh(logits / cap)
    attn_softcap: float | None = None  # Gemma 2's attention scores, likewise (kernels/softcap.py)
    rotary_dim: int | None = None  # the dims of a head RoPE turns, if not all (partial_rotary_factor)
    rope: dict = field(default_factory=dict)  # rope_theta, rope_type, factor, ...
    rope_local: dict | None = None  # sliding-window layers' RoPE where it is another (Gemma 3's)
    long_rope: bool = False  # LongRoPE's long factors, not its short ones (ModelConfig.reach)
    # each layer's sliding window (keys a query sees, its own included; 0: all before it)
    windows: tuple[int, ...] = ()
    nope: tuple[int, ...] = ()  # layers without RoPE (SmolLM3's every fourth): their keys carry no position
    # Granite's multipliers: of the embeddings, of each block's output before its residual
    # add, of the attention scores (None: 1/sqrt(head_dim)), and the divisor of the logits
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    clip_qkv: float | None = None  # OLMoE's: q, k and v clamped to +-clip_qkv after the norms
    # A mixture of experts: experts per sparse layer, how many each token takes, an
    # expert's MLP width, whether the chosen ones' weights are renormalised to sum to 1,
    # the layers that keep a dense MLP (Qwen-MoE's mlp_only_layers), and the width of a
    # shared expert every token takes beside its k, its output gated (Qwen2-MoE's; 0: none)
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk: bool = False
    dense_layers: tuple[int, ...] = ()
    shared_expert_size: int = 0
    quant: Quant | None = None  # 8-bit projections: the checkpoint's, or --quantization's (backend/quant.py)

    @classmethod
    def load(cls, folder: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """The model the folder's config.json describes (with vLLM's --hf-overrides over it)."""
        file = Path(folder) / "config.json"
        if not file.is_file():
            raise InvalidRequest(f"no config.json in model folder {folder}", "model")
        raw = overridden(_read(file), overrides or {})
        path = f"{file}{named(overrides or {})}"  # what the errors below name
        archs = raw.get("architectures") or []
        arch = next((families.ARCHITECTURES[a] for a in archs if a in families.ARCHITECTURES), None)
        if arch is None:
            known = ", ".join(sorted(families.ARCHITECTURES))
            raise InvalidRequest(
                f"unsupported architecture {archs or raw.get('model_type')}; supported: {known}",
                "model",
            )
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise InvalidRequest(f"{path} lacks {', '.join(missing)}", "model")
        bad = [k for k in COUNTS if raw.get(k) is not None and (type(raw[k]) is not int or raw[k] < 1)]
        if bad:
            raise InvalidRequest(f"{path}: {', '.join(bad)} must be positive integers", "model")
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        if arch == "phi3" and rope["rope_type"] in ("su", "yarn"):  # Phi-3's old names, as HF reads them
            rope["rope_type"] = "longrope"
        if raw.get("original_max_position_embeddings"):  # Phi-3 gives it beside its rope_scaling
            rope.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        extra = families.gemma(raw, arch, path) if arch in families.GEMMA else {}
        rope = extra.pop("rope", rope)
        return cls(
            arch=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_embeddings=bool(raw.get("tie_word_embeddings", arch in families.GEMMA)),
            qkv_bias=(arch == "qwen2" or bool(raw.get("attention_bias", False))
                      or (arch == "qwen2_moe" and bool(raw.get("qkv_bias", True)))),
            qk_norm=("head" if arch in ("qwen3", "qwen3_moe", "gemma3") else "all" if arch in ("olmo2", "olmoe")
                     else None),
            post_norm=arch == "olmo2",
            rope=rope,
            windows=families.windows(raw, arch, path),
            nope=families.nope(raw, path) if arch == "smollm3" else (),
            rotary_dim=families.rotary_dim(raw, rope, head_dim, path),
            **(families.granite(raw, path) if arch in ("granite", "granitemoe") else {}),
            **(families.experts(raw, arch, path) if arch in families.MOE else {}),
            quant=quant.parse(raw.get("quantization_config"), path),
            **extra,
        )

    @property
    def context(self) -> int:
        """Positions the model reads: max_position_embeddings, but LongRoPE's short factors
        hold only to original_max_position_embeddings."""
        if self.rope.get("rope_type") == "longrope" and not self.long_rope:
            return min(self.max_position, self.rope.get("original_max_position_embeddings") or self.max_position)
        return self.max_position

    def reach(self, max_model_len: int) -> ModelConfig:
        """The model for a server of `max_model_len` positions (0: the model's own), LongRoPE's
        factors chosen once for the server as vLLM chooses them: the long ones where that
        passes original_max_position_embeddings (Phi-3.5's and Phi-4-mini's 4,096), for every
        sequence at every length. HF picks per forward pass instead, by the sequence's length
        then, so the two agree on any sequence that starts past it or ends within it."""
        orig = self.rope.get("original_max_position_embeddings")
        if self.rope.get("rope_type") != "longrope" or not isinstance(orig, int):
            return self
        return replace(self, long_rope=(max_model_len or self.max_position) > orig)

    def window(self, layer: int) -> int:
        """`layer`'s sliding window: 0 for full attention."""
        return self.windows[layer] if self.windows else 0

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.experts > 0 and layer not in self.dense_layers

    def kv_bytes_per_token(self, elem_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_size


def _read(path: Path) -> dict:
    """A JSON object from the model folder; InvalidRequest naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise InvalidRequest(f"{path} is not valid JSON: {e}", "model") from e
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{path} is not a JSON object", "model")
    return raw
