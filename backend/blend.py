"""Selective recomputation over reused KV (CacheBlend's forward), for a batch of prompts.

Every prompt arrives with its blocks filled: reused tokens hold base KV copied from the
segment cache, fresh tokens hold nothing yet. Layers before the check layer run in full
(their K/V are then exact for every token). At the check layer all tokens are computed
once more, and each prompt's reused tokens whose fresh K/V deviate most from the reused
values are selected. Later layers run only the fresh and selected tokens (their hidden
states carry forward); every other token keeps its reused K/V. The math per prompt does
not depend on which other prompts share the batch: attention is per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.kernels.deviation import kv_deviation, select_top


@dataclass(slots=True)
class BlendInput:
    tokens: list[int]
    blocks: list[int]
    reused: list[bool]  # per prompt token: KV came from a base


@dataclass(slots=True)
class BlendResult:
    logits: torch.Tensor  # [N, vocab], next-token logits per prompt
    selected: list[list[int]]  # per prompt: reused positions that were recomputed
    work: int  # token-layers computed


def _meta(items: list[BlendInput], rows: list[torch.Tensor], block_size: int, device,
          fresh: bool = False) -> AttnMeta:
    """Attention metadata for the given token positions (rows) of each prompt; `fresh`
    when every row of every prompt is being computed (layers before the check layer)."""
    width = max(len(it.blocks) for it in items)
    tables = torch.zeros(len(items), width, dtype=torch.int32)
    slots, cu = [], [0]
    for i, (it, pos) in enumerate(zip(items, rows)):
        tables[i, : len(it.blocks)] = torch.tensor(it.blocks, dtype=torch.int32)
        blocks = torch.tensor(it.blocks, dtype=torch.int64)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + len(pos))
    return AttnMeta(
        positions=torch.cat(rows).to(device),
        slots=torch.cat(slots).to(device),
        cu_q=torch.tensor(cu, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        kv_lens=torch.tensor([len(it.tokens) for it in items], dtype=torch.int32, device=device),
        max_q=max(len(r) for r in rows),
        fresh_cu=cu if fresh else None,
    )


@torch.inference_mode()
def blend(model: Decoder, cache: KVCache, items: list[BlendInput], check_layer: int,
          ratio: float) -> BlendResult:
    device = model.lm_head.weight.device
    bsz = cache.block_size
    full = [torch.arange(len(it.tokens)) for it in items]
    meta = _meta(items, full, bsz, device, fresh=True)
    ids = torch.tensor([t for it in items for t in it.tokens], device=device)
    x = model.embed(ids)
    offsets = [0]
    for it in items:
        offsets.append(offsets[-1] + len(it.tokens))
    selected: list[list[int]] = [[] for _ in items]
    work = 0
    for li, layer in enumerate(model.layers):
        work += x.shape[0]
        if li != check_layer:
            x = layer(x, meta, cache)
            continue
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x))
        kc = cache.k[li].view(-1, *k.shape[1:])
        vc = cache.v[li].view(-1, *v.shape[1:])
        dev = kv_deviation(k, v, kc[meta.slots], vc[meta.slots])
        groups = []
        for i, it in enumerate(items):
            mask = torch.tensor(it.reused, dtype=torch.bool)
            groups.append(torch.nonzero(mask).flatten().to(device) + offsets[i])
        picks = select_top(dev, groups, ratio)
        cache.store(li, k, v, meta.slots)
        x = x + attn.attend(q, meta, cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        # From here on only fresh tokens, the selected ones and each prompt's last token.
        rows = []
        for i, it in enumerate(items):
            keep = ~torch.tensor(it.reused, dtype=torch.bool)
            sel = picks[i].cpu() - offsets[i]
            keep[sel] = True
            keep[-1] = True
            rows.append(torch.nonzero(keep).flatten())
            selected[i] = sel.tolist()
        take = torch.cat([r + offsets[i] for i, r in enumerate(rows)]).to(device)
        x = x[take]
        meta = _meta(items, rows, bsz, device)
    last = meta.cu_q[1:].long() - 1
    return BlendResult(model.logits(x[last]), selected, work)
