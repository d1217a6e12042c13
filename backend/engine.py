"""The engine loop: add requests, step, collect deltas (synchronous core)."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from pathlib import Path

import structlog
import torch

from tokendance.backend import heap, loader, parallel, pooling, quant, scoring
from tokendance.backend.api import REUSING, Delta, InvalidRequest, Pooling, SamplingParams, check_mode
from tokendance.backend.banned import sequences
from tokendance.backend.blocks import BlockManager
from tokendance.backend.budget import pool_tokens
from tokendance.backend.collector import Collector, ReuseConfig
from tokendance.backend.config import EngineConfig, ModelConfig
from tokendance.backend.detok import Detok, Pieces
from tokendance.backend.device import host_threads, host_tier_bytes, pick_device
from tokendance.backend.generation import ends
from tokendance.backend.grammar import Grammars
from tokendance.backend.idle import IdleAgents
from tokendance.backend.lookahead import Inflight, eligible, launch
from tokendance.backend.model import KVCache
from tokendance.backend.pool import BlockPool
from tokendance.backend.prompt import check
from tokendance.backend.published import Run, runs
from tokendance.backend.runner import Runner
from tokendance.backend.sampler import Sampled, sample
from tokendance.backend.scheduler import Scheduled, Scheduler
from tokendance.backend.segments import SegmentCache, check_spans, min_shared
from tokendance.backend.speculate import Speculator
from tokendance.backend.sequence import Sequence, Status
from tokendance.backend.stops import ended
from tokendance.backend.thinking import Thought
from tokendance.backend.waiting import Waiting
from tokendance.kernels import packed
from tokendance.kernels.jit import tiles_head

log = structlog.get_logger(__name__)


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, **overrides):
        cfg = cfg or EngineConfig(**overrides)
        self.cfg = cfg
        self.speculator = Speculator.of(cfg.speculative_config, cfg.overlap)  # a bad config before the weights
        self.device = pick_device(cfg.device)
        self.dtype = cfg.dtype_on(self.device)
        self.folder: Path = loader.resolve(cfg.model, cfg.revision, cfg.download_dir)
        self.config_folder = loader.config_folder(self.folder, cfg.hf_config_path, cfg.revision, cfg.download_dir)
        model = ModelConfig.load(self.config_folder, cfg.hf_overrides).reach(cfg.max_model_len)
        model = replace(model, quant=quant.choose(cfg.quantization, model.quant, f"{self.config_folder}/config.json"))
        self.tp = parallel.shard_for(cfg, self.device, model)
        if self.tp is not None:
            self.device = self.tp.device
        # the leader's calls go to the followers (backend/parallel.py)
        self.relay = parallel.Relay(self.tp) if self.tp is not None and self.tp.rank == 0 else None
        try:
            self._build(cfg, model)
        except BaseException:
            if self.relay is not None:
                self.relay.close(clean=False)
            raise

    def _build(self, cfg: EngineConfig, model: ModelConfig) -> None:
        threads = host_threads(self.device, os.environ)
        if threads is not None and threads != torch.get_num_threads():
            log.info("torch CPU threads", before=torch.get_num_threads(), now=threads,
                     hint="OMP_NUM_THREADS chooses")
            torch.set_num_threads(threads)
        if self.device.type == "cpu":  # before the weights: they join the kept heap too
            heap.keep()
        # before the weights, which a tokenizer that is not the model's would have loaded for nothing
        self.tokenizer = loader.tokenizer(self.folder, cfg.tokenizer, model.vocab_size, cfg.trust_remote_code,
                                          cfg.tokenizer_revision or cfg.revision, cfg.download_dir)
        free0 = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0  # before the weights
        if cfg.random_weights:
            if self.tp is not None:  # what every rank holds whole must match
                torch.manual_seed(cfg.seed)
            self.model = loader.build(model, self.dtype, self.device, self.tp)
        else:
            self.model = loader.load(self.folder, model, self.dtype, self.device, self.tp, self.config_folder)
        packed.pack(self.model)
        self.mcfg = self.model.cfg
        self.pieces = Pieces(self.tokenizer)  # tokens' texts alone, for logprobs
        # vLLM's served name: the model as given (a path stays a path)
        self.name = loader.DEFAULT_MODEL if cfg.model in (None, "", "default") else cfg.model
        self.eos = set(ends(self.config_folder, self.tokenizer))
        self.grammars = Grammars(self.tokenizer, self.mcfg.vocab_size, sorted(self.eos))
        budget = cfg.max_batched_tokens or (16384 if self.device.type == "cuda" else 2048)
        held = cfg.kv_dtype(self.dtype)
        per_token = self.mcfg.kv_bytes_per_token(held.itemsize)
        tokens = pool_tokens(cfg, self.model, self.device, per_token, budget, free0)
        ranks = self.ranks
        if self.tp is not None:  # one schedule: every rank's pool the same size
            tokens = self.tp.least(tokens)
        self.cache = KVCache(self.mcfg, max(2, tokens // cfg.block_size), cfg.block_size, self.dtype, self.device,
                             held)
        self.pool = BlockPool(self.cache.num_blocks)
        self.blocks = BlockManager(self.pool, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_seqs, budget, cfg.scheduling_policy)
        self.runner = Runner(self.model, self.cache)
        self.runner.late_from = cfg.check_layer
        if self.device.type == "cuda" and not tiles_head(self.mcfg.head_dim):
            log.warning("attention in plain torch", head_dim=self.mcfg.head_dim,
                        why="the Triton kernels take even head dims from 16 to 256; no CUDA graphs either")
        elif self.device.type == "cuda" and cfg.cuda_graphs:  # graphs replay the Triton kernels
            max_blocks = -(-self.mcfg.context // cfg.block_size)
            self.runner.capture(min(cfg.cuda_graphs, cfg.max_seqs), max_blocks, self.cache.trash_block)
        self.segments = SegmentCache(self.pool, cfg.block_size,
                                     int(self.cache.num_blocks * cfg.segment_cache_fraction))
        self.scheduler.reclaim = self.segments.evict  # bases go before any request is preempted
        reuse = ReuseConfig(cfg.check_layer, cfg.recompute_ratio, cfg.recompute_floor, max_tokens=budget,
                            readers=cfg.bases == "reader", anchor_bytes=cfg.anchor_bytes // ranks,
                            anchor_rank=cfg.anchor_rank)
        offload = host_tier_bytes(self.device) if cfg.offload_bytes is None else cfg.offload_bytes
        self.idle = IdleAgents(self.cache, offload, ranks)
        self.collector = Collector(self.model, self.cache, self.blocks, self.runner, self.segments,
                                   self.idle, reuse)
        self.waiting = Waiting(self.collector, self.scheduler, self.idle, self.blocks)
        limits = (self.mcfg.context, self.cache.num_blocks * cfg.block_size, cfg.max_model_len)  # model, pool, flag
        self.max_model_len = min(x for x in limits if x)
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.overlap = cfg.overlap if cfg.overlap is not None else self.device.type == "cuda" and not self.speculator
        self.min_shared = min_shared(cfg.min_shared_tokens, self.device)
        self.inflight: Inflight | None = None  # the last decode step's tokens, not read yet
        self.tails: list[tuple[Sequence, list[Run], int]] = []  # finished, K/V due up to the int
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        if self.device.type == "cpu":
            heap.trim()  # what loading left free; serving's peak is kept from here on
        log.info("engine ready", model=str(self.folder), device=str(self.device),
                 dtype=str(self.dtype).removeprefix("torch."), kv_dtype=str(held).removeprefix("torch."),
                 kv_blocks=self.cache.num_blocks,
                 max_model_len=self.max_model_len, host_tier_mib=self.idle.tier.arena.data.nbytes >> 20)

    @property
    def kv_bytes_per_token(self) -> int:
        """The whole model's: with tensor parallelism, every rank's KV heads."""
        return self.mcfg.kv_bytes_per_token(self.cache.k[0].element_size()) * self.ranks

    @property
    def ranks(self) -> int:
        """Processes this engine runs in (tensor parallelism)."""
        return 1 if self.tp is None else self.tp.size

    # -- requests ------------------------------------------------------------------

    def check(self, prompt: list[int], sampling: SamplingParams, pooled: bool = False) -> None:
        """Raise InvalidRequest unless the engine can serve this prompt (`pooled`: embed it)."""
        check(prompt, sampling, self.max_model_len, self.mcfg.vocab_size, self.grammars, pooled,
              self.scheduler.ranked, self.cfg.max_logprobs)

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams, mode: str = "full",
            shared: list[tuple[int, int]] | None = None, tenant: str = "", publish: bool = False,
            agent: str | None = None, pool: Pooling | None = None) -> None:
        """Queue a request. `shared`: [lo, hi) token spans of shared segments, reused in
        the REUSING modes; `publish`: keep its output's KV as the next round's base (producer
        bases; kvcmas's always);
        `agent`: who sent it (a session's agent): in the REUSING modes its KV is
        parked when it finishes, and the agent's next request restores the prefix they
        share (`full` stays the no-reuse baseline; `prefix` has its block cache);
        `pool`: an embedding request (backend/pooling.py), exact, so never by reuse."""
        # for the followers, packed before anything changes (queued once the request is in)
        call = None if self.relay is None else self.relay.pack("add", rid, prompt, sampling, mode, shared,
                                                               tenant, publish, agent, pool)
        self.check(prompt, sampling, pool is not None)
        check_mode(mode)
        mode = "full" if sampling.prompt_logprobs is not None else mode  # scored prompts are computed whole
        mode = "prefix" if pool is not None and mode in REUSING else mode
        if rid in self.seqs:
            raise InvalidRequest(f"duplicate request id {rid}", "id")
        spans = [(lo, hi) for lo, hi in check_spans(shared or [], len(prompt)) if hi - lo >= self.min_shared]
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        ends = sorted(t for t in set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos)
                      if 0 <= t < self.mcfg.vocab_size)  # another id is never sampled
        seq = Sequence(rid, list(prompt), sampling, Detok.of(self.tokenizer, sampling),
                       generator=gen, ends=ends, mode=mode, shared=spans, tenant=tenant,
                       publish=publish and (self.cfg.bases == "producer" or mode == "kvcmas"),
                       sender=agent or "", bad=sequences(self.tokenizer, sampling.bad_words),
                       scored=None if sampling.prompt_logprobs is None else scoring.start(prompt, self.pieces),
                       pooling=pool, arrival=next(self._arrivals))
        if sampling.think_budget is not None:
            seq.thought = Thought.of(sampling.think_budget, prompt)
        st = sampling.structure
        if st is not None:
            seq.until = self.tokenizer.encode(st.after, add_special_tokens=False) if st.after else []
            if not seq.until:
                seq.matcher = self.grammars.matcher(st)
        self.seqs[rid] = seq
        self.waiting.add(seq, agent)
        if call is not None:
            self.relay.queue(call)

    def abort(self, rid: str) -> bool:
        if self.relay is not None:
            self.relay.call("abort", rid)
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        self.waiting.drop(seq)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self.waiting.seqs) or self.scheduler.has_work() or self.inflight is not None

    # -- the loop ------------------------------------------------------------------

    def step(self) -> list[tuple[str, Delta]]:
        out = self._step() if self.relay is None else self.relay.step(self._step)
        if self.tp is not None:
            self.tp.note(out)
        if self.tails:
            self._close_tails()
        if not self.has_work():
            self.runner.release()
        return out

    def _step(self) -> list[tuple[str, Delta]]:
        out = []
        if self.inflight is not None and (self.waiting.seqs or self.scheduler.waiting):
            out += self._land()
        out += self._blend() if self.waiting.seqs else []
        if self.tails:  # requests that ended above give their blocks back before scheduling
            self._close_tails()
        if self.speculator is not None:
            self.speculator.draft(self.scheduler.running, self.max_model_len)
        work, starved = self.scheduler.schedule()
        # A step of decodes leaves its tokens on the device (lookahead); the last step's
        # feed this one there only if it decodes the same batch, else the host reads
        # them first.
        ahead = self.overlap and self._decode(work) and eligible([w.seq for w in work])
        chain = (ahead and self.inflight is not None and not starved
                 and [w.seq for w in work] == self.inflight.seqs)
        if self.inflight is not None and not chain:
            out += self._land()
            work = [w for w in work if w.seq.status is Status.RUNNING]
        out += [(s.id, self._finish(s, "length")) for s in starved if s.status is not Status.FINISHED]
        if not work:
            return out
        logits, kept = self.runner.run(work, self.inflight.tokens) if chain else self.runner.run(work)
        for w in work:
            w.seq.computed = w.start + w.count - w.drafts  # an accepted draft's K/V counts once it is
            self.blocks.publish(w.seq)
        ready = [w.seq for w in work if w.samples]
        scored, pooled = pooling.split(work, kept)
        scoring.record(work, scored, self.model, self.pieces)
        out += [(seq.id, self._finish(seq, "stop", v)) for seq, v in pooled]  # embeddings: done with the prompt
        if ahead:
            launched = launch(logits, ready, self.generator)
            out += self._land() if chain else []  # while the GPU runs this step
            self.inflight = launched
            return out
        if self.speculator is None:
            return out + [(s.id, self._advance(s, p)) for s, p in zip(ready, sample(logits, ready, self.generator))]
        for seq, picks in self.speculator.picks(logits, work, self.generator):
            seq.computed += len(picks) - 1  # the accepted drafts
            for pick in picks:
                out.append((seq.id, self._advance(seq, pick)))
                if seq.status is Status.FINISHED:
                    break
        return out

    def _decode(self, work: list[Scheduled]) -> bool:
        """A step of single-token decodes with room for one more token each."""
        return all(w.count == 1 and w.samples and len(w.seq) < self.max_model_len for w in work)

    def _land(self) -> list[tuple[str, Delta]]:
        """Read the last step's tokens (waiting for them) and advance their sequences;
        aborted or finished ones are skipped."""
        inflight, self.inflight = self.inflight, None
        out = []
        for seq, tok in zip(inflight.seqs, inflight.wait()):
            if seq.status is Status.FINISHED:
                continue
            out.append((seq.id, self._advance(seq, Sampled(tok), at=len(seq.out) - seq.lookahead)))
        return out

    def _blend(self) -> list[tuple[str, Delta]]:
        """Prefill waiting requests by reuse (backend/waiting.py), then let them decode."""
        return [(seq.id, self._advance(seq, pick)) for seq, pick in self.waiting.step(self.generator)]

    def _advance(self, seq: Sequence, pick: Sampled, at: int | None = None) -> Delta:
        """Take a sampled token: appended, or landing at out[at] in place of PENDING."""
        tok = pick.token
        if at is None:
            seq.out.append(tok)
            at = len(seq.out) - 1
        else:
            seq.out[at] = tok
            seq.lookahead -= 1
        n = at + 1  # tokens generated, this one included
        p = seq.sampling
        if seq.thought is not None:
            seq.thought.take(seq.out[:n])
        reason, hit = ended(seq, tok, n, self.max_model_len)
        if not reason and seq.until and seq.out[max(n - len(seq.until), 0):n] == seq.until:
            seq.until = []  # the grammar holds what follows
            seq.matcher = self.grammars.matcher(p.structure)
        if reason:
            del seq.out[n:]  # a token sampled past the end, by a step of lookahead
            seq.lookahead = 0
            seq.computed = min(seq.computed, len(seq))
            delta = self._finish(seq, reason)
            delta.stop_reason = hit
        else:
            delta = Delta(text=seq.detok.take(final=False))
        delta.token_ids = [tok]
        delta.prompt_logprobs = seq.scored if at == 0 else None
        if pick.logprob is not None:
            delta.logprobs = [pick.written(self.pieces)]
        return delta

    def _finish(self, seq: Sequence, reason: str, embedding: list[float] | None = None) -> Delta:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        text = seq.detok.take(final=True)
        usage = seq.usage(self.kv_bytes_per_token, self.cfg.block_size)
        self.seqs.pop(seq.id, None)
        pub = runs(seq.out, seq.detok.text, self.encode) if seq.publish and seq.blocks else []
        end = len(seq.prompt) + max((r.end for r in pub), default=0)
        if pub and end > seq.computed:
            # Ended by length on a token it never fed: that K/V first (_close_tails).
            self.scheduler.remove(seq, keep_blocks=True)
            self.tails.append((seq, pub, end))
        else:
            self._close(seq, pub)
        return Delta(text=text, finish_reason=reason, usage=usage, embedding=embedding)

    def _close(self, seq: Sequence, pub: list[Run]) -> None:
        """A finished request lets go of its KV: its output's (the runs `pub`) kept as
        their bases for the next round when it publishes, its agent's parked, its blocks
        freed."""
        for r in pub:
            self.collector.publish_output(seq, r.ids, r.at)
        if seq.agent is not None:
            self.idle.park(seq.agent, seq)
        self.scheduler.remove(seq)

    def _close_tails(self) -> None:
        """The K/V of publishing requests' unfed ends, in one forward (its logits unused),
        then they close: without room for it, their outputs are not published."""
        tails, self.tails = self.tails, []
        work = [Scheduled(s, s.computed, end - s.computed) for s, _, end in tails
                if self.blocks.reserve(s, end)]
        if work:
            self.runner.run(work)
            for w in work:
                w.seq.computed = w.start + w.count
        for s, pub, _ in tails:
            self._close(s, pub)

    def reset_caches(self, anchors: bool = True) -> None:
        """Forget every reusable KV (segment bases, prefix blocks, idle agents, keys held for
        decode; kvcomm's and kvcmas's anchors too unless `anchors` is False): a cold start."""
        if self.relay is not None:
            self.relay.call("reset_caches", anchors)
        if anchors:
            self.collector.anchors.clear()
        for name in list(self.idle.parked):
            self.idle.drop(name)
        self.segments.clear()
        self.pool.forget()
        self.runner.release()

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do without them); the engine
        takes no calls after."""
        if self.relay is not None:
            self.relay.close()

    # -- convenience ---------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 mode: str = "full", shared: list[list[tuple[int, int]]] | None = None,
                 publish: bool = False, agents: list[str] | None = None) -> list[tuple[list[int], str, str]]:
        """Run prompts to completion: (token ids, text, finish reason) each; `agents`: who sends each."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"gen-{i}" for i in range(len(prompts))]
        results: dict[str, tuple[list[int], list[str], str]] = {r: ([], [], "") for r in ids}
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
            self.add(rid, prompt, p, mode, shared[i] if shared else None, publish=publish,
                     agent=agents[i] if agents else None)
        while self.has_work():
            for rid, d in self.step():
                toks, text, _ = results[rid]
                toks.extend(d.token_ids)
                text.append(d.text)
                if d.finish_reason:
                    results[rid] = (toks, text, d.finish_reason)
        return [(t, "".join(x), r) for t, x, r in (results[i] for i in ids)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
