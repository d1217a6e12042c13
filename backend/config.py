"""Configuration: the engine's (EngineConfig) and the model's (ModelConfig, read from an
HF folder's config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tokendance.backend.api import BASES, KV_DTYPES, POLICIES, REUSE_DEFAULTS, InvalidRequest
from tokendance.backend.overrides import named, overridden
from tokendance.kernels.fp8 import FP8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# config.json fields without a default, and the other counts (positive integers all)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
COUNTS = (*REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder, .gguf, or None for the embedded default
    tokenizer: str | None = None  # vLLM's --tokenizer: a folder's instead of the model's own
    hf_config_path: str | None = None  # vLLM's: a folder's config.json instead of the model's own
    hf_overrides: dict[str, Any] = field(default_factory=dict)  # vLLM's: fields set over config.json
    max_logprobs: int = 20  # vLLM's: the alternatives a token's logprobs may list (-1: any)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # vLLM's: the pool's K/V in the model's dtype, or fp8 (kernels/fp8.py)
    device: str = "auto"  # with tensor parallelism, the first of its devices
    tensor_parallel_size: int = 1  # processes (on CUDA, GPUs) that split each layer (backend/parallel.py)
    block_size: int = 16
    kv_tokens: int = 0  # pool size in tokens; 0: 16k on CPU, on CUDA as gpu_memory_utilization says
    # vLLM's: the share of the GPU's memory this engine holds, weights, a step's peak and the
    # pool together (backend/budget.py); 0: the pool takes 85 % of what the weights leave free
    gpu_memory_utilization: float = 0.0
    max_seqs: int = 256
    scheduling_policy: str = "fcfs"  # vLLM's: or "priority", by each request's priority (backend/scheduler.py)
    max_batched_tokens: int = 0  # per step; 0: 2048 on CPU, 16384 on CUDA
    max_model_len: int = 0  # 0: the model's limit (capped by the pool)
    seed: int = 0
    random_weights: bool = False  # timing only: the folder needs config.json (and a tokenizer)
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
        if self.max_logprobs < -1:
            raise InvalidRequest("max_logprobs must be -1 (any) or at least 0", "max_logprobs")
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


ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",  # Llama's, with some layers that take no RoPE (NoPE)
    "GraniteForCausalLM": "granite",  # Llama's, with scaled embeddings, residuals, scores and logits
    # norms before and after attention and MLP, GeGLU, capped scores, sliding windows on every other layer
    "Gemma2ForCausalLM": "gemma2",
    # Gemma 2's, scores uncapped, q and k normed, sliding windows with their own RoPE on 5 layers of 6
    "Gemma3ForCausalLM": "gemma3",
    "Olmo2ForCausalLM": "olmo2",  # norms after attention and MLP, none before; q and k normed whole
    "Phi3ForCausalLM": "phi3",  # Phi-3, 3.5, 4-mini: LongRoPE, a part of each head rotated (4-mini)
    # mixtures of experts (backend/moe.py), their layers otherwise Mistral's, Qwen's, OLMo's, Granite's
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",  # with a shared expert every token takes
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",  # Granite's multipliers too
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")
GEMMA = ("gemma2", "gemma3")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")


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

    @classmethod
    def load(cls, folder: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """The model the folder's config.json describes (with vLLM's --hf-overrides over it)."""
        file = Path(folder) / "config.json"
        if not file.is_file():
            raise InvalidRequest(f"no config.json in model folder {folder}", "model")
        raw = overridden(_read(file), overrides or {})
        path = f"{file}{named(overrides or {})}"  # what the errors below name
        archs = raw.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            known = ", ".join(sorted(ARCHITECTURES))
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
        extra = _gemma(raw, arch, path) if arch in GEMMA else {}
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
            tie_embeddings=bool(raw.get("tie_word_embeddings", arch in GEMMA)),
            qkv_bias=(arch == "qwen2" or bool(raw.get("attention_bias", False))
                      or (arch == "qwen2_moe" and bool(raw.get("qkv_bias", True)))),
            qk_norm=("head" if arch in ("qwen3", "qwen3_moe", "gemma3") else "all" if arch in ("olmo2", "olmoe")
                     else None),
            post_norm=arch == "olmo2",
            rope=rope,
            windows=_windows(raw, arch, path),
            nope=_nope(raw, path) if arch == "smollm3" else (),
            rotary_dim=_rotary_dim(raw, rope, head_dim, path),
            **(_granite(raw, path) if arch in ("granite", "granitemoe") else {}),
            **(_moe(raw, arch, path) if arch in MOE else {}),
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


def _nope(raw: dict, path: str) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` (1: RoPE, 0: none, a flag a layer),
    else every `no_rope_layer_interval`-th layer, as transformers reads them."""
    n = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = raw.get("no_rope_layer_interval", 4)
        if type(every) is not int or every < 1:
            raise InvalidRequest(f"{path}: no_rope_layer_interval must be a positive integer", "model")
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise InvalidRequest(f"{path}: no_rope_layers must give 0 or 1 for each of the {n} layers", "model")
    return tuple(i for i, f in enumerate(flags) if not f)


def _windows(raw: dict, arch: str, path: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), as transformers reads each architecture's
    config: every layer's (Mistral, Mixtral, Phi-3, Qwen3-MoE), or the layers `layer_types`
    names, else those its rule picks (Qwen2 and Qwen3 from max_window_layers on, Qwen2-MoE
    the even ones below it, SmolLM3 its NoPE ones, Gemma 2 the even ones, Gemma 3 all but
    every sliding_window_pattern-th); () for none."""
    n = raw["num_hidden_layers"]
    use = raw.get("use_sliding_window", arch in ("mistral", "mixtral", "phi3") + GEMMA)
    size = raw.get("sliding_window", 4096 if arch in ("mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                   + GEMMA else None)
    if not use or not size or arch not in ("mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen2_moe",
                                           "qwen3_moe", "smollm3") + GEMMA:
        return ()
    if type(size) is not int or size < 1:
        raise InvalidRequest(f"{path}: sliding_window must be a positive integer, not {size!r}", "model")
    if arch in ("mistral", "mixtral", "phi3", "qwen3_moe"):
        return (size,) * n
    kinds = raw.get("layer_types")
    if kinds is None:
        first = raw.get("max_window_layers", 28) if arch in ("qwen2", "qwen3", "qwen2_moe") else 0
        if type(first) is not int:
            raise InvalidRequest(f"{path}: max_window_layers must be an integer", "model")
        if arch == "smollm3":
            nope = set(_nope(raw, path))
            return tuple(size if i in nope else 0 for i in range(n)) if nope else ()
        if arch in GEMMA:  # every `sliding_window_pattern`-th layer reads all (Gemma 2: every other)
            every = raw.get("sliding_window_pattern", 6) if arch == "gemma3" else 2
            if type(every) is not int or every < 1:
                raise InvalidRequest(f"{path}: sliding_window_pattern must be a positive integer", "model")
            kinds = ["sliding_attention" if (i + 1) % every else "" for i in range(n)]
        elif arch == "qwen2_moe":
            kinds = ["sliding_attention" if i % 2 == 0 and i < first else "" for i in range(n)]
        else:
            kinds = ["sliding_attention" if i >= first else "" for i in range(n)]
    elif not isinstance(kinds, list) or len(kinds) != n or any(
            k not in ("sliding_attention", "full_attention") for k in kinds):
        raise InvalidRequest(f"{path}: layer_types must name sliding_attention or full_attention "
                             f"for each of the {n} layers", "model")
    out = tuple(size if k == "sliding_attention" else 0 for k in kinds)
    return out if any(out) else ()


def _gemma(raw: dict, arch: str, path: str) -> dict:
    """Gemma 2's and 3's fields, as transformers reads them: scores scaled by
    query_pre_attn_scalar and capped at attn_logit_softcapping (Gemma 2's default 50),
    logits at final_logit_softcapping (Gemma 2's 30), embeddings scaled by the square root
    of the width; Gemma 3's sliding-window layers turn keys with a RoPE of their own
    (rope_parameters by layer type, or rope_theta and rope_local_base_freq)."""
    if raw.get("use_bidirectional_attention"):
        raise InvalidRequest(f"{path}: use_bidirectional_attention (an encoder's) is not supported", "model")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise InvalidRequest(f"{path}: hidden_activation {raw['hidden_activation']!r} is not supported; "
                             "Gemma uses gelu_pytorch_tanh", "model")
    out: dict = dict(sandwich=True, norm_offset=True, act="gelu_tanh",
                     embedding_multiplier=raw["hidden_size"] ** 0.5)
    if arch == "gemma3":
        by_type = raw.get("rope_parameters") or {}
        if "full_attention" in by_type or "sliding_attention" in by_type:
            full, local = dict(by_type.get("full_attention") or {}), dict(by_type.get("sliding_attention") or {})
        else:
            full, local = dict(raw.get("rope_scaling") or {}), {}
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
        for r in (full, local):
            r["rope_type"] = r.get("rope_type", r.get("type", "default"))
        out.update(rope=full, rope_local=local)
    caps = (None, None) if arch == "gemma3" else (50.0, 30.0)  # transformers' defaults
    numbers = dict(query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
                   attn_logit_softcapping=raw.get("attn_logit_softcapping", caps[0]),
                   final_logit_softcapping=raw.get("final_logit_softcapping", caps[1]))
    for key, v in numbers.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise InvalidRequest(f"{path}: {key} must be a positive number", "model")
    attn, final = numbers["attn_logit_softcapping"], numbers["final_logit_softcapping"]
    return dict(out, attention_multiplier=float(numbers["query_pre_attn_scalar"]) ** -0.5,
                attn_softcap=None if attn is None else float(attn),
                logit_softcap=None if final is None else float(final))


def _rotary_dim(raw: dict, rope: dict, head_dim: int, path: str) -> int | None:
    """How many of a head's dims RoPE turns, if not all (partial_rotary_factor)."""
    share = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * share) if isinstance(share, (int, float)) and not isinstance(share, bool) else 0
    if not 2 <= dim <= head_dim or dim % 2:
        raise InvalidRequest(f"{path}: partial_rotary_factor {share!r} leaves no even share of the "
                             f"{head_dim} dims of a head", "model")
    return None if dim == head_dim else dim


def _granite(raw: dict, path: str) -> dict[str, float]:
    """Granite's multipliers, as transformers defaults them (1.0 each: the attention's too)."""
    out = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        v = raw.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise InvalidRequest(f"{path}: {key} must be a positive number", "model")
        out[key] = float(v)
    return out


def _moe(raw: dict, arch: str, path: str) -> dict:
    """A mixture of experts' fields, as transformers reads each architecture's config."""
    n = raw["num_hidden_layers"]
    keys = dict(experts="num_experts" if "num_experts" in raw else "num_local_experts",
                experts_per_token="num_experts_per_tok",
                expert_size="moe_intermediate_size" if arch in QWEN_MOE else "intermediate_size")
    if arch == "qwen2_moe":
        keys["shared_expert_size"] = "shared_expert_intermediate_size"
    out = {name: raw.get(key) for name, key in keys.items()}
    for name, v in out.items():
        if type(v) is not int or v < 1:
            raise InvalidRequest(f"{path}: {keys[name]} must be a positive integer, not {v!r}", "model")
    if out["experts_per_token"] > out["experts"]:
        raise InvalidRequest(f"{path}: num_experts_per_tok {out['experts_per_token']} exceeds the "
                             f"{out['experts']} experts", "model")
    # GraniteMoE's softmax over the k best logits is the renormalised top k of the whole one
    out["norm_topk"] = arch in ("mixtral", "granitemoe") or bool(raw.get("norm_topk_prob", False))
    dense: set[int] = set()
    if arch in QWEN_MOE:
        only, step = raw.get("mlp_only_layers") or [], raw.get("decoder_sparse_step", 1)
        if type(step) is not int or step < 1 or not isinstance(only, list) or any(
                type(i) is not int or not 0 <= i < n for i in only):
            raise InvalidRequest(f"{path}: decoder_sparse_step must be a positive integer and "
                                 f"mlp_only_layers layer indices below {n}", "model")
        dense = set(only) | {i for i in range(n) if (i + 1) % step}
    out["dense_layers"] = tuple(sorted(dense))
    clip = raw.get("clip_qkv") if arch == "olmoe" else None
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise InvalidRequest(f"{path}: clip_qkv must be a positive number", "model")
    out["clip_qkv"] = None if clip is None else float(clip)
    return out


def _read(path: Path) -> dict:
    """A JSON object from the model folder; InvalidRequest naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise InvalidRequest(f"{path} is not valid JSON: {e}", "model") from e
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{path} is not a JSON object", "model")
    return raw
