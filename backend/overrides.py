"""vLLM's `--hf-overrides`: fields set over the model's config.json before it is read, as
for a longer context (`{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}`, YaRN as
the Qwen2.5 and Qwen3 model cards give it) or a shorter window. Each field replaces the
file's whole; RoPE is the one field known under two names (transformers 5 writes
`rope_parameters`, older files and vLLM's docs `rope_scaling`), so RoPE given under either
replaces the file's under both."""

from __future__ import annotations

import json
from typing import Any

ROPE = ("rope_parameters", "rope_scaling")


def overridden(raw: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`raw` with `over`'s fields in its place. A RoPE override without a rope_theta keeps
    the file's (transformers 5 holds it inside the RoPE parameters, where the override
    would drop it); a rope_theta alone goes where the file holds it."""
    out = {**raw, **over}
    held = next((k for k in ROPE if isinstance(raw.get(k), dict) and "rope_theta" in raw[k]), None)
    given = next((k for k in ROPE if k in over), None)
    if given is not None:
        for k in ROPE:
            if k != given:
                out.pop(k, None)
        rope = over[given]
        if held is not None and isinstance(rope, dict) and "rope_theta" not in rope and "rope_theta" not in over:
            out[given] = {"rope_theta": raw[held]["rope_theta"], **rope}
    elif held is not None and "rope_theta" in over:
        out[held] = {**raw[held], "rope_theta": over["rope_theta"]}
    return out


def named(over: dict[str, Any]) -> str:
    """How an error names a config read under `over`."""
    return f" under --hf-overrides {json.dumps(over)}" if over else ""
