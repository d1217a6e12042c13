"""Model folders for timing with random weights: the shapes of real checkpoints.

A folder holds config.json and the embedded model's tokenizer files (token ids in the
benchmarks are drawn below the tokenizer's vocabulary, so they are valid for both).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tokendance.backend import loader
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine

QWEN_COMMON = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, eos_token_id=151645)

# Gemma 3's text models: sliding windows of 512 keys (RoPE base 10 k) on 5 layers of 6,
# 4 query heads of 256 over 1 kv head, GeGLU, sandwich norms
GEMMA3_COMMON = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                     query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                     sliding_window=512, sliding_window_pattern=6, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, eos_token_id=1, bos_token_id=2)

SHAPES = {
    "qwen2.5-0.5b": dict(QWEN_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(QWEN_COMMON, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-14b": dict(QWEN_COMMON, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8),
    "qwen3-8b": dict(QWEN_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                     max_position_embeddings=40960, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # head dims that are not a power of two: 120 (H2O Danube3-4B) and 80 (Danube2-1.8B)
    "danube3-4b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
                       hidden_size=3840, intermediate_size=10240, num_hidden_layers=24,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=120,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, eos_token_id=2),
    "danube2-1.8b": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000,
                         hidden_size=2560, intermediate_size=6912, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None,
                         tie_word_embeddings=False, eos_token_id=2),
    # a sliding window of 4,096 keys on every layer, a context of 32 k
    "mistral-7b-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000,
                            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                            rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4096,
                            tie_word_embeddings=False, eos_token_id=2),
    # Gemma 2: attention scores capped at 50 and logits at 30, windows of 4,096 keys on every
    # other layer, 8 query heads of 256 over 4 kv heads
    "gemma-2-2b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000,
                       hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                       query_pre_attn_scalar=256, rope_theta=10000.0, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=1, bos_token_id=2),
    # LongRoPE: a context of 128 k over an original 4 k, 32 heads of 96 (the factors are ours:
    # a shape times the same whatever they are)
    "phi-3.5-mini": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064,
                         hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, max_position_embeddings=131072,
                         original_max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(type="longrope", short_factor=[1.0 + i / 48 for i in range(48)],
                                           long_factor=[1.0 + i * i / 48 for i in range(48)]),
                         sliding_window=262144, tie_word_embeddings=False, pad_token_id=32000, eos_token_id=32000),
    "gemma-3-1b": dict(GEMMA3_COMMON, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26),
    "gemma-3-270m": dict(GEMMA3_COMMON, hidden_size=640, intermediate_size=2048, num_hidden_layers=18),
    # every fourth layer without RoPE (NoPE)
    "smollm3-3b": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=128256,
                       hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
                       rope_theta=5000000.0, rms_norm_eps=1e-6, no_rope_layer_interval=4,
                       tie_word_embeddings=True, pad_token_id=128004, eos_token_id=128012),
    # mixtures of experts: 8 of 128 experts a token (3.3 B of 30.5 B parameters), and 8 of 64
    # (1.3 B of 6.9 B; small enough to time beside HF on one GPU)
    "qwen3-30b-a3b": dict(QWEN_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          vocab_size=151936, max_position_embeddings=40960, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe-1b-7b": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304,
                        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, pad_token_id=1, eos_token_id=50279),
    # 8 of 32 experts a token (0.4 B of 1.3 B parameters): a mixture a CPU runs
    "granitemoe-1b": dict(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", vocab_size=49155,
                          hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
                          num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8,
                          max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                          embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                          logits_scaling=6.0, tie_word_embeddings=True, eos_token_id=0),
}


def shape_folder(name: str) -> Path:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    out = loader.cache_dir() / "shapes" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name], indent=1))
    tok = os.environ.get("TOKENDANCE_TOKENIZER")  # a folder with tokenizer files
    src = Path(tok) if tok else loader.resolve(None)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def save_random(name: str, dest: Path, vocab: bool = False, layers: int | None = None) -> Path:
    """A folder of shape `name` with random bf16 weights saved in it, loadable by any
    `tokendance` process (for benchmarks that start servers, which load real folders).
    `vocab`: the vocabulary (and end-of-sequence token) is the tokenizer's, not the
    checkpoint's (a structured output's mask then covers real tokens only, as it does
    for the real model; the embedded tokenizer has 49,152 of the shape's 152,064 ids).
    `layers`: fewer than the shape's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = shape_folder(name)
    # made with its layers (transformers derives per-layer fields from them as it makes one)
    fields = dict(SHAPES[name], **({} if layers is None else {"num_hidden_layers": layers}))
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if vocab:
        tok = AutoTokenizer.from_pretrained(src)
        cfg.vocab_size, cfg.eos_token_id = len(tok), tok.eos_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dest / f.name)
    return dest


def resolve(model: str | None, random: bool = False) -> tuple[str | None, bool]:
    """A benchmark's --model: (folder or file to load, random weights?). An existing
    path (or None, the embedded default) as given; anything else is a shape name."""
    if model and not Path(model).exists():
        return str(shape_folder(model)), True
    return model, random


def round_engine(model: str | None, dtype: str, kv_tokens: int, random: bool = False,
                 **cfg) -> tuple[Engine, int]:
    """The round benchmarks' engine (--model a path or a shape name; 16 k tokens a step,
    half the pool for segment bases; every shared segment reused, however short: its length
    is the benchmark's to choose), and the vocabulary their token ids are drawn below."""
    folder, random = resolve(model, random)
    cfg.setdefault("min_shared_tokens", 0)
    eng = Engine(EngineConfig(model=folder, dtype=dtype, random_weights=random, kv_tokens=kv_tokens,
                              max_batched_tokens=16384, segment_cache_fraction=0.5, **cfg))
    return eng, min(eng.mcfg.vocab_size, len(eng.tokenizer))


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    own = "--tokenizer-vocab" in args
    args = [a for a in args if a != "--tokenizer-vocab"]
    if len(args) != 2:
        sys.exit("usage: python -m tokendance.bench.shapes SHAPE DEST [--tokenizer-vocab] (a folder of random weights)")
    print(save_random(args[0], Path(args[1]), own))
