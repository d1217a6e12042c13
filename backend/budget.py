"""How many tokens the KV pool holds.

`--kv-tokens` as given; on the CPU, 16 k. On a GPU, 85 % of the memory the weights leave
free; or, with vLLM's `--gpu-memory-utilization F`, what F of the GPU's memory leaves
once this engine's weights (and the workspaces its libraries took), the peak of its
largest step and its decode graphs are counted. Both are measured at start, as torch's
allocator holds them: one forward of `max_num_batched_tokens` fresh prompt tokens, its
K/V stored nowhere, their logprobs scored as a prompt's are (backend/scoring.py), and
the decode graphs captured once over a pool of two blocks, then let go. A cold
collective round also holds the hidden states of up to `AHEAD` forwards queued ahead
(backend/collector.py): counted as their size. As in vLLM the share is this engine's:
other processes on the GPU count only in what is free; the CUDA context, made before
anything is measured, is outside it.
"""

from __future__ import annotations

import gc

import structlog
import torch

from tokendance.backend import scoring
from tokendance.backend.api import TOP_LOGPROBS
from tokendance.backend.collector import AHEAD
from tokendance.backend.config import EngineConfig, top_logprobs
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.kernels.jit import tiles_head

log = structlog.get_logger(__name__)

CPU_TOKENS = 16384
FREE_SHARE = 0.85  # of what the weights leave free, without a utilization


def pool_tokens(cfg: EngineConfig, model: Decoder, device: torch.device, per_token: int, step: int,
                free0: int) -> int:
    """The pool's size in tokens; `step`: the most tokens a step computes; `free0`: the
    GPU's free bytes when the engine began, before its weights."""
    util = cfg.gpu_memory_utilization
    if cfg.kv_tokens:
        return cfg.kv_tokens
    if cfg.num_gpu_blocks_override:
        return cfg.num_gpu_blocks_override * cfg.block_size
    if cfg.kv_cache_memory_bytes:
        return cfg.kv_cache_memory_bytes // per_token
    if device.type != "cuda":
        if util:
            raise ValueError("--gpu-memory-utilization needs a GPU: on the CPU --kv-tokens sizes the pool")
        return CPU_TOKENS
    if not util:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * FREE_SHARE) // per_token
    total = torch.cuda.mem_get_info(device)[1]
    want = int(util * total)
    if free0 < want:
        raise ValueError(f"--gpu-memory-utilization {util} asks for {want / 2**30:.1f} GiB of the GPU's "
                         f"{total / 2**30:.1f}; {free0 / 2**30:.1f} GiB were free")
    peak = step_peak(model, step, device, cfg.max_logprobs) + ahead(model, step)
    graphs = graphs_reserve(cfg, model, device)
    held = free0 - torch.cuda.mem_get_info(device)[0]
    kv = want - held - peak - graphs
    g = 2**30
    if kv < 2 * cfg.block_size * per_token:  # the fewest blocks a pool has
        raise ValueError(f"--gpu-memory-utilization {util} leaves no room for the KV pool: the weights hold "
                         f"{held / g:.1f} GiB, a step of {step} tokens {peak / g:.1f} GiB and the decode graphs "
                         f"{graphs / g:.1f} GiB of the {want / g:.1f} GiB")
    log.info("memory budget", util=util, budget_gib=round(want / g, 2), weights_gib=round(held / g, 2),
             step_gib=round(peak / g, 2), graphs_gib=round(graphs / g, 2), kv_gib=round(kv / g, 2))
    return kv // per_token


class _Nowhere:
    """Stands in for the pool in `step_peak`: a step's K/V go nowhere."""

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        pass


def ahead(model: Decoder, step: int) -> int:
    """The bytes of the hidden states (and residuals) a cold collective round keeps for
    the forwards it queues ahead of its blends, each of up to `step` tokens."""
    p = next(model.parameters())
    return AHEAD * step * 2 * model.cfg.hidden_size * p.element_size()


def _settled(device: torch.device) -> int:
    """What torch's allocator holds once everything queued has run and what is free has
    gone back."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def graphs_reserve(cfg: EngineConfig, model: Decoder, device: torch.device) -> int:
    """The bytes the engine's decode graphs hold (0 without them): captured once, as the
    engine captures them, over a pool of two blocks, then let go."""
    if not (cfg.cuda_graphs and tiles_head(model.cfg.head_dim)):
        return 0
    from tokendance.backend.graphs import DecodeGraphs

    base = _settled(device)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.cfg, 2, cfg.block_size, dtype, device, cfg.kv_dtype(dtype))
    pool = _settled(device) - base
    graphs = DecodeGraphs(model, cache, min(cfg.cuda_graphs, cfg.max_seqs),
                          -(-model.cfg.context // cfg.block_size), cache.trash_block, cfg.check_layer)
    held = _settled(device) - base - pool
    del graphs, cache
    _settled(device)
    return held


@torch.inference_mode()
def step_peak(model: Decoder, tokens: int, device: torch.device, top: int = TOP_LOGPROBS) -> int:
    """The bytes torch's allocator holds at the peak of a forward of `tokens` fresh prompt
    tokens, beyond what it held before (prompts no longer than the model's positions),
    scoring them with `top` alternatives a token (--max-logprobs; -1: the vocabulary)."""
    top = top_logprobs(top, model.cfg.vocab_size)
    longest = model.cfg.context
    lens = [min(longest, tokens - lo) for lo in range(0, tokens, longest)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    base = _settled(device)
    torch.cuda.reset_peak_memory_stats(device)
    none = torch.zeros(len(lens), 0, dtype=torch.int32, device=device)
    meta = AttnMeta(positions=torch.cat([torch.arange(n, device=device) for n in lens]), slots=none,
                    cu_q=torch.tensor(cu, dtype=torch.int32, device=device), block_tables=none,
                    kv_lens=none.sum(1), max_q=max(lens), fresh_cu=cu)
    x, res = model.embed(torch.zeros(tokens, dtype=torch.long, device=device)), None
    for layer in model.layers:
        x, res = layer(x, meta, _Nowhere(), res)
    last = torch.tensor(cu[1:], device=device) - 1
    model.logits(x[last], res[last])
    h = model.model.norm.add(x[:scoring.ROWS], res[:scoring.ROWS])[0]  # a step that scores its prompt
    scoring.scores(model, h, torch.zeros(len(h), dtype=torch.long, device=device), top)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base
    del x, res, meta
    _settled(device)  # what the step freed goes back: counted once, as its peak
    return peak
