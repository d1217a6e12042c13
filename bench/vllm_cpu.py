"""The same All-Gather rounds served by real vLLM-CPU with prefix caching: the baseline.

Runs under its own venv (.venv-vllm, see bench/README.md), never imports tokendance.
Input: the rounds written by `tokendance bench reuse --dump-prompts FILE`, a JSON object
{"N": [[token ids], ...], ...}, or by `tokendance bench resume --dump-prompts FILE`,
{"N": {"before": [[token ids], ...], "prompts": [[token ids], ...]}, ...}: a second round
and what the first left in a prefix cache (its prompts with their answers). For each N,
all N prompts are submitted together as token-id prompts (one `LLM.generate` call) with
`max_tokens` = --decode (1: prefill to the first token, like ours). Timed per round,
median of --repeats:

- cold: `reset_prefix_cache()` before each repeat, so nothing is reused across
  repeats (as ours clears its caches); what prefix caching finds inside the round
  itself still counts, as it would in serving. For a second round, the `before` prompts
  are then prefilled (one token each, not timed), so the round finds round 1 cached, as
  it would after round 1 had run (vLLM caches the full blocks of generated tokens too).
- warm: the same prompts once more without a reset (every full block is a cache hit):
  for information, the best case prefix caching could ever reach.

    .venv-vllm/bin/python bench/vllm_cpu.py --prompts rounds.json --json vllm.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this folder would lead sys.path, and its modules would shadow real
# packages that vllm / transformers probe (bench/kernels.py hides `kernels`).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

DEFAULT_MODEL = Path.home() / ".cache" / "tokendance" / "SmolLM2-135M-Instruct"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="JSON rounds from `tokendance bench reuse --dump-prompts`")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF folder (default: our SmolLM2 folder)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--agents", default=None, help="comma list of N to run (default: every round in the file)")
    p.add_argument("--decode", default="1", help="max_tokens per agent, comma list (1 = prefill only)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-space", type=int, default=None,
                   help="GiB of KV cache (VLLM_CPU_KVCACHE_SPACE; default: fits the largest round twice)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="chunked-prefill token budget per step (vLLM-CPU default for LLM: 4096)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    p.add_argument("--threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: every core this process may use, e.g. 0-1; "
                        "vLLM's own 'auto' keeps one core for its scheduler and computes on the rest)")
    p.add_argument("--heap", choices=["keep", "default"], default="keep",
                   help="keep: glibc's malloc in vLLM's engine processes set as our CPU engine sets it "
                        "(backend/heap.py: no mmap, no trim, one arena; through glibc's MALLOC_* variables, "
                        "read when a process starts); default: as glibc comes")
    p.add_argument("--json", default=None, help="write rows here")
    return p.parse_args(argv)


# backend/heap.py's mallopt settings, as the environment glibc reads at a process's start
HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_ARENA_MAX": "1"}


def kv_bytes_per_token(model: str, dtype: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head * (4 if dtype == "float32" else 2)


def load_rounds(path: str) -> dict[int, tuple[list[list[int]], list[list[int]]]]:
    """{N: (before, prompts)}: each round's prompts, and what the round before it left in
    the prefix cache (nothing for a first round)."""
    out = {}
    for n, v in json.loads(Path(path).read_text()).items():
        out[int(n)] = (v["before"], v["prompts"]) if isinstance(v, dict) else ([], v)
    return out


def table(rows: list[dict]) -> str:
    out = ["| N | round | prompt tokens | max_tokens | cold round ms | cached tokens (cold) | warm round ms "
           "| cached tokens (warm) |", "|" + "---|" * 8]
    for r in rows:
        out.append(f"| {r['agents']} | {r.get('round', 1)} | {r['prompt_tokens']} | {r['max_tokens']} | "
                   f"{r['cold_ms']:.0f} | {r['cold_cached']} | {r['warm_ms']:.0f} | {r['warm_cached']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rounds = load_rounds(args.prompts)
    agents = [int(a) for a in args.agents.split(",")] if args.agents else sorted(rounds)
    missing = [n for n in agents if n not in rounds]
    if missing:
        sys.exit(f"no round for N={missing} in {args.prompts}")
    decodes = [int(d) for d in args.decode.split(",")]
    longest = max(len(p) for n in agents for p in rounds[n][1])
    max_len = 256 * math.ceil((longest + max(decodes)) / 256)
    if args.kv_space is None:  # the largest round (and round 1), decode included, twice over, at least 1 GiB
        tokens = max(sum(len(p) + max(decodes) for p in rounds[n][0] + rounds[n][1]) for n in agents)
        args.kv_space = max(1, math.ceil(2 * tokens * kv_bytes_per_token(args.model, args.dtype) / 2**30))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space)  # read when the engine starts
    cores = sorted(os.sched_getaffinity(0))
    bind = args.threads_bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ",".join(map(str, cores))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if args.heap == "keep":  # vLLM's engine core and worker are processes started after this
        os.environ.update(HEAP_ENV)

    from vllm import LLM, SamplingParams  # noqa: PLC0415 (env first)
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    extra = {}
    if args.max_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=max_len,
              max_num_seqs=max(256, max(agents)), enforce_eager=args.eager, seed=0, **extra)
    startup = time.perf_counter() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    setup = dict(model=args.model, dtype=args.dtype, max_model_len=max_len, kv_space_gib=args.kv_space,
                 block_size=cache.block_size, max_num_batched_tokens=sched.max_num_batched_tokens,
                 chunked_prefill=sched.enable_chunked_prefill, eager=args.eager,
                 threads_bind=bind, heap=args.heap, startup_s=round(startup, 1))

    def run(prompts: list, sp: SamplingParams) -> tuple[float, int]:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in outs)
        return dt, sum(o.num_cached_tokens or 0 for o in outs)

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def reset(before: list) -> None:
        """An empty prefix cache, then round 1 in it if there is one."""
        llm.reset_prefix_cache()
        if before:
            run(before, one)

    rows = []
    for n in agents:
        before, prompts = ([TokensPrompt(prompt_token_ids=ids) for ids in r] for r in rounds[n])
        for i, d in enumerate(decodes):
            sp = SamplingParams(max_tokens=d, temperature=0.0, ignore_eos=True)
            if i == 0:  # warm-up, once per N
                reset(before)
                run(prompts, sp)
            cold, warm = [], []
            for _ in range(args.repeats):
                reset(before)
                cold.append(run(prompts, sp))
                warm.append(run(prompts, sp))
            rows.append(dict(agents=n, round=2 if before else 1, max_tokens=d,
                             prompt_tokens=sum(map(len, rounds[n][1])),
                             before_tokens=sum(map(len, rounds[n][0])),
                             cold_ms=1000 * statistics.median(t for t, _ in cold),
                             warm_ms=1000 * statistics.median(t for t, _ in warm),
                             cold_cached=max(c for _, c in cold), warm_cached=min(c for _, c in warm),
                             cold_all_ms=[round(1000 * t, 1) for t, _ in cold],
                             warm_all_ms=[round(1000 * t, 1) for t, _ in warm], **setup))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"vLLM-CPU on {args.model} ({args.dtype}); prefix caching on, block {setup['block_size']}, "
          f"chunked prefill {setup['chunked_prefill']} ({setup['max_num_batched_tokens']} tokens/step), "
          f"KV {args.kv_space} GiB, {'eager' if args.eager else 'torch.compile'}, threads on cores {bind}, "
          f"heap {args.heap}; "
          f"startup {startup:.0f} s")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
