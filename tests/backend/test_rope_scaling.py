"""Our RoPE frequencies equal transformers' for every scaling kind we support."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokendance.backend.rope_scaling import rope_params

CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
def test_matches_transformers(params):
    theta = 500000.0
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=32768,
                      rope_parameters={"rope_theta": theta, **params})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    ours, scale = rope_params({"rope_theta": theta, **params}, 128, 32768)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_default():
    inv, scale = rope_params({"rope_theta": 10000.0, "rope_type": "default"}, 64, 2048)
    assert scale == 1.0 and inv[0] == 1.0 and inv.shape == (32,)


@pytest.mark.parametrize("long", [False, True])
def test_longrope_matches_transformers_either_side_of_its_original_reach(long):
    """Phi-3's: HF takes the long factors for a sequence past original_max_position_embeddings."""
    short, far = [1.0 + i / 8 for i in range(64)], [2.0 + i / 4 for i in range(64)]
    params = {"rope_type": "longrope", "short_factor": short, "long_factor": far,
              "original_max_position_embeddings": 4096}
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                      rope_parameters={"rope_theta": 10000.0, **params})
    ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=4097 if long else 4096)
    ours, scale = rope_params({"rope_theta": 10000.0, **params}, 128, 131072, long)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale) and scale > 1
