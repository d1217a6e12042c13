"""The architectures ModelConfig loads, and the config.json fields particular to some of
them (sliding windows, NoPE layers, Gemma's, Granite's multipliers, experts), each read as
transformers reads that family's config. Every reader raises InvalidRequest naming
`path` (the file, and any --hf-overrides over it) for a value it cannot use."""

from __future__ import annotations

from tokendance.backend.api import InvalidRequest

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



def nope(raw: dict, path: str) -> tuple[int, ...]:
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


def windows(raw: dict, arch: str, path: str) -> tuple[int, ...]:
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
            unrotated = set(nope(raw, path))
            return tuple(size if i in unrotated else 0 for i in range(n)) if unrotated else ()
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


def gemma(raw: dict, arch: str, path: str) -> dict:
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


def rotary_dim(raw: dict, rope: dict, head_dim: int, path: str) -> int | None:
    """How many of a head's dims RoPE turns, if not all (partial_rotary_factor)."""
    share = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * share) if isinstance(share, (int, float)) and not isinstance(share, bool) else 0
    if not 2 <= dim <= head_dim or dim % 2:
        raise InvalidRequest(f"{path}: partial_rotary_factor {share!r} leaves no even share of the "
                             f"{head_dim} dims of a head", "model")
    return None if dim == head_dim else dim


def granite(raw: dict, path: str) -> dict[str, float]:
    """Granite's multipliers, as transformers defaults them (1.0 each: the attention's too)."""
    out = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        v = raw.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise InvalidRequest(f"{path}: {key} must be a positive number", "model")
        out[key] = float(v)
    return out


def experts(raw: dict, arch: str, path: str) -> dict:
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
