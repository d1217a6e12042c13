"""The in-process engine behind the proxy's Backend interface."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from tokendance.backend.api import Prepared, Request, Template, check_mode
from tokendance.backend.async_engine import AsyncEngine, Job
from tokendance.backend.config import EngineConfig, top_logprobs
from tokendance.backend.engine import Engine
from tokendance.backend.generation import defaults
from tokendance.backend.prompt import render_chat, request_ids
from tokendance.backend.protocol import Gauge, ModelInfo, Stream


@dataclass(slots=True)
class Tokens:
    """A prepared request's prompt: token ids, and the [start, end) span of each shared segment."""

    ids: list[int]
    shared: list[tuple[int, int]]
    mode: str


class EngineBackend:
    def __init__(self, engine: Engine, mode: str = "collective"):
        check_mode(mode)
        if not getattr(engine.tokenizer, "is_fast", False):  # prompts are tokenized with offsets
            raise ValueError(f"the tokenizer of {engine.name} has no fast (tokenizers) version: "
                             "add its tokenizer.json to the model folder")
        self.engine = engine
        self.mode = mode
        self.core = AsyncEngine(engine)
        cfg = engine.cfg
        sampling = defaults(engine.config_folder, cfg.generation_config, cfg.override_generation_config)
        self.info = ModelInfo(engine.name, engine.max_model_len, engine.kv_bytes_per_token, sampling,
                              priority=engine.scheduler.ranked, eos=tuple(sorted(engine.eos)),
                              max_logprobs=top_logprobs(cfg.max_logprobs, engine.mcfg.vocab_size))
        self._ids = itertools.count()

    @classmethod
    def load(cls, model: str | None = None, dtype: str = "auto", mode: str = "collective", **kw: Any
             ) -> "EngineBackend":
        return cls(Engine(EngineConfig(model=model, dtype=dtype, **kw)), mode)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        return render_chat(self.engine.tokenizer, messages, tools, template)

    def prepare(self, request: Request) -> Prepared:
        mode = request.mode or self.mode
        check_mode(mode)
        ids, shared = request_ids(self.engine.tokenizer, request)
        self.engine.check(ids, request.sampling, request.pooling is not None)
        return Prepared(request, len(ids), Tokens(ids, shared, mode), ids)

    def generate(self, group: list[Prepared]) -> list[Stream]:
        jobs = []
        for p in group:
            tok: Tokens = p.state
            rid = f"{p.request.id}#{next(self._ids)}"
            r = p.request
            agent = f"{r.session}/{r.agent}" if r.session is not None and r.agent is not None else None
            jobs.append(Job(rid, tok.ids, r.sampling, tok.mode, tok.shared, r.tenant,
                            publish=r.session is not None, agent=agent, pool=r.pooling))
        return list(self.core.submit(jobs))

    def gauges(self) -> list[Gauge]:
        """Read from the engine's thread without a lock: each figure is one int read, or
        a sum over a copy of the running list (the copy is atomic)."""
        e = self.engine
        dense = sum(s.computed for s in list(e.scheduler.running))
        return [
            Gauge("kv_blocks", "blocks in the KV pool", e.cache.num_blocks),
            Gauge("kv_blocks_free", "KV pool blocks free or held only by the prefix cache",
                  e.pool.num_free),
            Gauge("segment_blocks", "KV pool blocks held by shared segments' base KV (Masters)",
                  e.segments.held),
            Gauge("kv_held_bytes", "KV pool bytes in use (Masters, Mirrors' private blocks, prefix blocks)",
                  (e.cache.num_blocks - e.pool.num_free) * e.cfg.block_size * e.kv_bytes_per_token),
            Gauge("kv_dense_bytes", "KV the running requests would hold in dense per-request caches",
                  dense * e.kv_bytes_per_token),
            Gauge("sequences_running", "requests decoding or prefilling", len(e.scheduler.running)),
            Gauge("sequences_waiting", "requests waiting for the KV pool or their reuse prefill",
                  len(e.scheduler.waiting) + len(e.waiting.seqs)),
            Gauge("host_tier_bytes", "host memory holding idle agents' KV (each Master once)",
                  e.idle.bytes),
            Gauge("parked_agents", "idle agents whose KV waits in the host tier", len(e.idle.tier)),
            Gauge("preemptions_total", "running requests preempted (their KV freed, computed again later)",
                  e.scheduler.preemptions, "counter"),
            Gauge("restored_tokens_total", "prompt tokens restored from the host tier instead of prefilled",
                  e.idle.restored, "counter"),
            *(g for mode, a in e.collector.anchored.items() for g in (
                Gauge(f"{mode}_predicted_total", f"{mode} requests whose shared segments read base + an "
                      "offset predicted from anchors", a.predicted, "counter"),
                Gauge(f"{mode}_measured_total", f"{mode} requests prefilled exactly, each segment's offset "
                      "kept as an anchor", a.measured, "counter"))),
            Gauge("anchor_bytes", "memory holding kvcomm's and kvcmas's anchors", e.collector.anchors.nbytes * e.ranks),
            *(() if (s := e.speculator) is None else (
                Gauge("spec_decode_num_drafts_total", "decode steps of a request that fed drafted tokens",
                      s.drafts, "counter"),
                Gauge("spec_decode_num_draft_tokens_total", "drafted tokens fed", s.draft_tokens, "counter"),
                Gauge("spec_decode_num_accepted_tokens_total", "drafted tokens kept", s.accepted, "counter"))),
            Gauge("eager_decode_steps_total", "decode steps on CUDA no graph could replay (a batch "
                  "over the graphs' rows, or Mirrors reading 1,024 or more Master segments)",
                  e.runner.eager_decodes, "counter"),
        ]

    def problem(self) -> str | None:
        if self.core.loop is not None and not self.core.thread.is_alive():
            return "the engine has stopped"
        tp = self.engine.tp
        return tp.gone() if tp is not None else None

    async def close(self) -> None:
        await self.core.close()
