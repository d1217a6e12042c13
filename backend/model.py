"""Llama / Qwen2 / Qwen3 / Mistral / Gemma decoder (and the other architectures
backend/config.py takes), our own forward.

Every layer's K/V passes through `KVCache.store` (keys before RoPE) and attention reads
them back through the paged pool, so reuse policies can see and replace any layer's
KV. Projections are fused (qkv, gate_up); `loader.py` maps checkpoint names onto them.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tokendance.backend.config import ModelConfig
from tokendance.backend.moe import MLP, MoE
from tokendance.backend.parallel import Shard
from tokendance.backend.quant import linear
from tokendance.backend.rope_scaling import rotary
from tokendance.backend.start import Embedding, Linear
from tokendance.kernels.fp8 import as_bytes
from tokendance.kernels.master import MasterRead
from tokendance.kernels.norm import rms_norm
from tokendance.kernels.paged_attention import paged_attention
from tokendance.kernels.prefill import causal_attention
from tokendance.kernels.rope import rope_rotate
from tokendance.kernels.store import store
from tokendance.kernels.tiles import trig_table


@dataclass(slots=True)
class AttnMeta:
    """Where a forward pass's tokens sit: what attention and the cache store need."""

    positions: torch.Tensor  # [T] logical position of each token
    slots: torch.Tensor  # [T] flat pool slot each token's K/V is written to
    cu_q: torch.Tensor  # [S+1] query offsets per sequence
    block_tables: torch.Tensor  # [S, max_blocks]
    kv_lens: torch.Tensor  # [S] keys visible to each sequence after this step
    max_q: int  # the most queries of one sequence (known on the host: no device sync)
    # Host copy of cu_q when no sequence has earlier context in the pool: attention
    # then runs on this step's own K/V (causal SDPA), without paged reads.
    fresh_cu: list[int] | None = None
    slot_pos: torch.Tensor | None = None  # [S, slots]: positions of table slots (Mirrors)
    master: MasterRead | None = None  # decode with Mirrors: the Master, read collectively
    # Layers from `late_from` on store and read through `late` (Mirrors read a patched
    # Master there; see backend/mirror.py).
    late: AttnMeta | None = None
    late_from: int = 0
    # What attention works out once for all layers of the step (the CPU reference's
    # decode layout); each view has its own.
    plan: dict = field(default_factory=dict)

    def at(self, layer: int) -> AttnMeta:
        return self.late if self.late is not None and layer >= self.late_from else self


class KVCache:
    """Paged K/V of every layer in one tensor `kv` [layers, 2, num_blocks + 1, B, Hkv, D]
    (one base pointer: kernels that move a token's K/V in every layer at once, such as
    the host tier's, need no pointer table); `k[layer]`, `v[layer]` are views of it. Keys
    are stored before RoPE. The extra block is the trash: K/V nobody keeps (a Mirror's
    rows that the Master serves, padding rows of captured graphs) are written there and
    never read. `dtype` is the model's, in which K/V are computed; `held` the pool's
    (8-bit floats under --kv-cache-dtype fp8: kernels/fp8.py), by default the same."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, held: torch.dtype | None = None):
        shape = (cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.dtype = dtype
        self.kv = torch.zeros(shape, dtype=held or dtype, device=device)
        self.k = list(self.kv[:, 0].unbind(0))
        self.v = list(self.kv[:, 1].unbind(0))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.trash_block = num_blocks
        self.trash = num_blocks * block_size  # its first flat slot

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        store(k, v, slots, self.k[layer], self.v[layer])

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of flat slots src -> dst (distinct) in every layer, in one
        gather and one scatter."""
        if len(src):
            flat = as_bytes(self.kv).flatten(2, 3)
            flat.index_copy_(2, dst.to(flat.device), flat.index_select(2, src.to(flat.device)))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class RMSNorm(nn.Module):
    """With `offset` (Gemma's), scaling by 1 + weight (kernels/norm.py)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=self.offset)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one pass on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual, self.offset)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: "Rope", tp: Shard | None = None):
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.nq, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = linear(cfg.quant, cfg.hidden_size, (self.nq + 2 * self.nkv) * self.d, cfg.qkv_bias)
        self.o_proj = linear(cfg.quant, self.nq * self.d, cfg.hidden_size, False)
        if cfg.qk_norm is not None:
            whole = cfg.qk_norm == "all"
            self.q_norm = RMSNorm(self.d * (self.nq if whole else 1), cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.d * (self.nkv if whole else 1), cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.clip = cfg.clip_qkv
        self.rope = rope
        self.window = cfg.window(layer)  # a sliding window's keys, 0 for full attention
        self.softcap = cfg.attn_softcap or 0.0  # scores capped (Gemma 2), 0 for none
        self.scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else self.d ** -0.5

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q, k, v of shape [T, H, D] (q and k normed, per head or whole, where
        the model does so: the stored keys are the normed ones)."""
        q, k, v = self.qkv_proj(x).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], -1)
        t = x.shape[0]
        if self.qk_norm == "head":  # rows of one head each: the norm kernel's 2-D layout
            q = self.q_norm(q.reshape(-1, self.d))
            k = self.k_norm(k.reshape(-1, self.d))
        elif self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (a.clamp(-self.clip, self.clip) for a in (q, k, v))
        return q.view(t, self.nq, self.d), k.view(t, self.nkv, self.d), v.view(t, self.nkv, self.d)

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta,
              cache: KVCache) -> torch.Tensor:
        """k, v into the cache at meta.slots; returns q rotated to meta.positions (one
        launch on CUDA; on a CPU decode step over held keys, one batched matmul by the
        step's rotation matrices, made once for all layers)."""
        rot = self.rope
        step = meta.plan.get("rotated")
        if step is not None:
            store(k, v, meta.slots, cache.k[self.layer], cache.v[self.layer])
            return torch.bmm(q.float(), step.rotation(rot.inv_freq, rot.scale)).to(q.dtype)
        return store(k, v, meta.slots, cache.k[self.layer], cache.v[self.layer], q, meta.positions,
                     rot.inv_freq, rot.scale)

    def attend(self, q: torch.Tensor, meta: AttnMeta, cache: KVCache) -> torch.Tensor:
        """Attention of rotated queries over what the cache holds; [T, hidden]."""
        o = paged_attention(
            q, meta.positions, meta.cu_q, cache.k[self.layer], cache.v[self.layer],
            meta.block_tables, meta.kv_lens, self.rope.inv_freq, self.rope.scale, self.scale,
            meta.max_q, meta.slot_pos, meta.master, self.rope.trig, meta.plan, self.window, self.softcap,
        )
        return self.out(o)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [T, H, D] projected back to [T, hidden] (summed over the
        tensor-parallel ranks' heads)."""
        x = self.o_proj(o.flatten(1))
        return x if self.tp is None else self.tp.sum(x)

    def forward(self, x: torch.Tensor, meta: AttnMeta, cache: KVCache) -> torch.Tensor:
        q, k, v = self.qkv(x)
        if meta.fresh_cu is None:
            return self.attend(self.store(q, k, v, meta, cache), meta, cache)
        cache.store(self.layer, k, v, meta.slots)
        rot = self.rope
        q = rope_rotate(q, meta.positions, rot.inv_freq, rot.scale)
        k = rope_rotate(k, meta.positions, rot.inv_freq, rot.scale)
        return self.out(causal_attention(q, k, v, meta.fresh_cu, self.scale, meta.cu_q, self.window,
                                         self.softcap))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rope: "Rope", tp: Shard | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, idx, rope, tp)
        self.mlp = MoE(cfg, tp) if cfg.sparse(idx) else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, x: torch.Tensor, meta: AttnMeta, cache: KVCache,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state x + residual (x alone if residual is None) through the layer,
        as the next such pair: each residual add runs inside the norm after it."""
        h, residual = self.pre(x, residual)
        return self.post(self.self_attn(h, meta, cache), residual)

    def pre(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, x + residual)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.add(x, residual)

    def post(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output `o` added in, then the MLP: the next layer's pair."""
        h, residual = self.post_attention_layernorm.add(o, residual)
        return self.mlp(h), residual


class PostNormLayer(Layer):
    """OLMo 2's: the attention and the MLP read the sum itself, and their outputs are
    normed before they are added to it."""

    def __init__(self, cfg: ModelConfig, idx: int, rope: "Rope", tp: Shard | None = None):
        nn.Module.__init__(self)
        self.self_attn = Attention(cfg, idx, rope, tp)
        self.mlp = MoE(cfg, tp) if cfg.sparse(idx) else MLP(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        s = x if residual is None else x + residual
        return s, s

    def post(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + self.post_attention_layernorm(o)
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class SandwichLayer(Layer):
    """Gemma's: attention and MLP each between a norm of their input and one of their
    output, the latter's sum with the residual stream feeding the next norm."""

    def __init__(self, cfg: ModelConfig, idx: int, rope: "Rope", tp: Shard | None = None):
        super().__init__(cfg, idx, rope, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def post(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(o), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Rope(nn.Module):
    """A layer's RoPE. Without `positional` (a NoPE layer) every angle is zero: the kernels
    rotate by the identity, so such a layer runs the same code with no position in it."""

    def __init__(self, cfg: ModelConfig, positional: bool = True):
        super().__init__()
        # a model built on the meta device (its shapes alone: backend/checkpoint.py) computes
        # these on the CPU: arithmetic on meta tensors first imports torch's compiler (~1 s)
        with torch.device("cpu") if torch.empty(0).is_meta else nullcontext():
            inv_freq, scale, _ = rotary(cfg)
            if not positional:
                inv_freq, scale = torch.zeros_like(inv_freq), 1.0
            # cos/sin per position for the kernels' tiles of scattered positions (Mirrors)
            trig = trig_table(inv_freq, cfg.context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("trig", trig, persistent=False)
        self.scale = scale


class Decoder(nn.Module):
    """HF-compatible parameter names under `model.` and `lm_head`. With a tensor-parallel
    shard, cfg is this rank's part (backend/parallel.py)."""

    def __init__(self, cfg: ModelConfig, tp: Shard | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.rope = Rope(cfg)
        self.nope = Rope(cfg, positional=False) if cfg.nope else None
        # sliding-window layers' RoPE, where it is another (Gemma 3's)
        self.local = Rope(replace(cfg, rope=cfg.rope_local)) if cfg.rope_local else None
        self.model = nn.Module()
        vocab = cfg.vocab_size if tp is None else tp.rows(cfg.vocab_size)  # this rank's rows
        self.model.embed_tokens = Embedding(vocab, cfg.hidden_size)
        # the embeddings' multiplier in the weights' dtype, as Gemma's rounds it (Granite's 12 is exact)
        self.embed_scale = float(torch.tensor(cfg.embedding_multiplier, dtype=torch.get_default_dtype(),
                                                 device="cpu"))  # a number, also where the model is built on meta
        kind = PostNormLayer if cfg.post_norm else SandwichLayer if cfg.sandwich else Layer
        self.model.layers = nn.ModuleList(kind(cfg, i, self.layer_rope(i), tp) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_rope(self, i: int) -> Rope:
        if i in self.cfg.nope:
            return self.nope
        return self.local if self.local is not None and self.cfg.window(i) else self.rope

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table, m = self.model.embed_tokens, self.embed_scale
        if self.tp is None:
            return table(ids) if m == 1.0 else table(ids) * m
        local = ids - self.tp.rank * table.num_embeddings
        mine = (local >= 0) & (local < table.num_embeddings)
        x = table(torch.where(mine, local, 0)) * (mine[:, None].to(table.weight.dtype) * m)
        return self.tp.sum(x)  # each token's row from the rank that holds it

    def logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the hidden states x + residual (a last layer's pair)."""
        return self.head(self.model.norm.add(x, residual)[0])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits, in float32, of final (normed) hidden states."""
        logits = self.lm_head(h)
        if self.tp is not None:  # every rank's vocabulary rows, the padding dropped
            logits = self.tp.gather(logits)[:, :self.cfg.vocab_size]
        s, cap = self.cfg.logits_scaling, self.cfg.logit_softcap
        logits = logits.float() if s == 1.0 else logits.float() / s
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def states(self, ids: torch.Tensor, meta: AttnMeta, cache: KVCache,
               last: torch.Tensor | None = None) -> torch.Tensor:
        """The final (normed) hidden states [len(last), hidden] of the rows `last` (all
        rows if None): what `head` reads."""
        x, residual = self.embed(ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, meta.at(i), cache, residual)
        if last is not None:
            x, residual = x[last], residual[last]
        return self.model.norm.add(x, residual)[0]

    def forward(self, ids: torch.Tensor, meta: AttnMeta, cache: KVCache,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(last), vocab] of the rows `last` (all rows if None)."""
        return self.head(self.states(ids, meta, cache, last))
