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
