#!/usr/bin/env bash
# The GPU benchmarks in one call on the lent H200: `bash bench/h200.sh [section ...]`
# (default: all), run by the `device` tool from the repository root with `.whl`
# (structlog) and `.device/tok` (tokenizer files) carried. Sections:
#   engine: the CUDA checks, then Qwen2.5-7B shape, random bf16 weights, against HF SDPA
#   qwen3: the engine on a Qwen3-8B shape (per-head q/k norms), random bf16 weights, against HF SDPA;
#     qwen3-reuse: the All-Gather round of `reuse` (N = 10, 20) on it, full, prefix and collective
#   embed: embeddings (pooling requests) against HF's base model over the same prompts, Qwen2.5-7B
#     shape, random bf16 weights
#   act: the fused SwiGLU activation against torch's two ops (error, time)
#   prefill: the engine's prefill alone against HF (10 x 2 k)
#   check: the CUDA checks alone (bench/check_cuda.py), and the GPU-only tests
#   tests: a dozen of the engine's test files on CUDA (its device is auto there): greedy vs HF,
#     reuse, Mirrors, idle agents, lookahead, priority, kvcomm, offload, bases, late layers, sampling,
#     sliding windows, Gemma 3 and 2, Phi-3 (LongRoPE), 8-bit KV pools
#   kv-dtype: decode steps in an 8-bit KV pool (--kv-cache-dtype fp8) against a bf16 one, Qwen2.5-7B
#     shape, random bf16 weights (bench/kv_dtype.py), then its attention kernels alone over either
#     pool (bench/kernels.py --decode --fp8, bench/collective.py --fp8); greedy tokens against HF
#     past LongRoPE's original reach (Phi-3.5-mini's shape, 2 layers, 5,000 tokens)
#   fp8-decode: where an 8-bit pool's decode kernel loses its time: variants of it (keys rotated in
#     float16, fewer registers, smaller key tiles), ablations (no values, no keys), and the launches
#     left uncapped (slot positions, a window) capped and not, over a bf16 and an e4m3 pool
#     (bench/fp8_decode.py); the collective kernel over either pool, capped too (bench/collective.py);
#     fp8-step: the engine's decode step over either pool (32 x 4,096, bench kv-dtype's first command)
#   quant: 8-bit weights (--quantization fp8): their engine tests on CUDA, the rounding kernel, the
#     tensor cores against the reference in layers and in an engine, CUDA-graph decode over them
#     (bench/check_quant.py), each layer's time by part (bench/fp8_linear.py), then prefill and decode
#     steps against bf16 weights, Qwen2.5-7B shape, random weights (bench kv-dtype)
#   fp8-load: checkpoints stored in 8 bits, the rows rounded as they are read, and models built
#     without drawing the weights a checkpoint fills: their tests on CUDA, bench/check_quant.py
#   fp8-block: block-wise 8-bit weights (FP8 checkpoints' weight_block_size): their tests on CUDA,
#     then the layer against bf16 and per-row 8-bit weights at Qwen3-8B's widths (bench/fp8_block.py);
#     fp8-block-sweep: the same with the block product's launch configurations (--sweep; BLOCK_ROWS=1,8,..
#     picks the row counts)
#     fp8-block-engine: the engine's prefill and decode steps over a block-wise checkpoint
#     (`tokendance quantize --block 128`) and over a per-row one, each against bf16 weights (bench
#     kv-dtype --weights), Qwen2.5-7B shape, random bf16 weights saved first
#   speculate: n-gram speculation's tests on CUDA, then a step's time with 0 to 4 drafts a sequence
#     against a decode step (a graph's), Qwen2.5-7B shape, random bf16 weights (bench speculate --cost)
#   load: the memory and time of loading a Qwen2.5-7B shape (random bf16 weights saved, then
#     `tokendance quantize`d) four ways (bench/fp8_load.py); with LOAD_BASELINE (an earlier
#     checkout's root) each way also by that code
#   scoring: a prefill that scores its prompt (prompt logprobs: completions' echo with
#     logprobs) against the same prefill without, Qwen2.5-7B shape, random bf16 weights
#   reuse:  one All-Gather round, N = 10 and 20, every mode, serial pic and collective with
#     reader bases, profiled at N = 10 (and r = 5 % at N = 10)
#   gaps: one cold N = 10 round per mode traced with Python stacks: where the GPU waits
#     on the host, and which of our code runs meanwhile (bench/gaps.py)
#   policy: the same rounds at r = 4.5 %, the share the recommended policy (floor 0.3,
#     docs/fidelity.md) recomputes on SmolLM2's debate prompts (random weights here)
#   readers: the same rounds at r = 30 %, full, collective and collective with reader bases
#     (with reader bases, the policy that keeps half the N = 8 debates identical to exact
#     prefill, docs/fidelity.md), then their round latency with 128 decoded tokens (capacity)
#   mirrors: CUDA checks of Mirrors (graphs = eager, pic = collective, ratio 1 = full, the
#     diff encode kernel = its reference; with reader bases pic = collective and readers =
#     full)
#   collective: collective decode attention against paged decode (bench/collective.py)
#   capacity: round latency with 128 decoded tokens per agent, prefix vs collective (and
#     collective at r = 4.5 %)
#   kvcomm: the reuse round with kvcomm (anchors from an earlier round) beside full, prefix, pic
#     and collective, then capacity (128 decoded tokens per agent) against prefix and collective
#   kvcmas: the reuse round and the resumed round with kvcmas (low-rank anchors) beside kvcomm
#     and collective
#   fanout: the reuse round beyond All-Gather: each agent reads K of the N outputs (N = 10: K = 10,
#     5, 2, 1; N = 20: K = 20, 10, 5, 2, 1), full, collective (also serial pic and reader bases) and kvcomm
#   bounds: the reuse round and capacity with nothing recomputed (r = 0): what the
#     workload allows any recompute policy (footprint, vs serial pic, capacity)
#   mirror-decode: decode steps over N = 10 and 20 Mirrors against dense caches
#   restore: idle agents back from the host tier, fused (Master once + diffs) vs dense
#     (no model: a KVCache of the Qwen2.5-7B K/V shape filled with random bf16)
#   resume: a second round, agents resumed from the host tier vs prefilled, and vs both
#     rounds in `prefix` mode (what vLLM does), and in `kvcomm` mode (resumed and predicted)
#   sweep: the paged decode kernel's launch configurations (bench/kernels.py --decode)
#   steps: a decode step at batch 32 x 4k split into GPU forward and host time
#   fleet: simulations side by side through a proxy over an engine per GPU against one engine
#     (bench/fleet.py); on a machine of one GPU, two engines sharing it
#   parallel: tensor parallelism: two ranks on one GPU against one process (bench/check_parallel.py,
#     also in check), then, on a machine of two GPUs or more (nvidia-h200-x2 and up;
#     bench/parallel.py), a Qwen2.5-0.5B shape end to end, then the Qwen2.5-14B shape at each size,
#     then a follower killed mid-step over NCCL (bench/check_parallel.py --death)
#   headdims: head dims that are not a power of two (bench/head_dims.py: the engine at Danube3-4B's
#     and Danube2-1.8B's shapes against HF, the kernels against the reference and timed; with
#     HEADDIMS_BASELINE, an earlier checkout's kernels folder, timed against it at head dim 128)
#   headdims-engine: the engine on Danube3-4B's shape against HF, now and as it ran before (the
#     references on the GPU, no CUDA graphs)
#   windows: sliding windows and Gemma 3 (bench/windows.py: the kernels against the reference and
#     timed against no window at Mistral 7B's attention, the prefill kernel's launch configurations at
#     Gemma 3's head dim 256; greedy tokens against HF past the window on 6 layers of Gemma 3 1B's
#     shape and 2 of Mistral 7B v0.1's; the engine on both whole shapes against HF)
#   gemma2: Gemma 2's capped attention scores (bench/softcap.py: the kernels against the reference
#     and timed against uncapped at Gemma 2 2B's attention, a fresh prompt's capped kernel against
#     flash); greedy tokens against HF (eager: its SDPA cannot cap) past the window on 4 layers of
#     Gemma 2 2B's shape; the engine on the whole shape against HF
#   smollm3: SmolLM3's layers without RoPE (NoPE) on the GPU: greedy tokens against HF on 4 layers
#     of its 3B shape (the fourth takes no RoPE), CUDA-graph decode against eager, and the engine
#     benchmark on the whole shape against HF
#   moe: mixtures of experts: the fused expert kernel against the loop over experts and torch's
#     grouped GEMM (bench/moe.py), greedy tokens against HF on 4 layers of OLMoE-1B-7B's and
#     Qwen3-30B-A3B's shapes, CUDA-graph decode against eager, then moe-engine;
#     moe-engine: the engine on OLMoE-1B-7B's whole shape against HF;
#     moe-sweep: the fused kernel's launch configurations (bench/moe.py --sweep);
#     moe-reuse: the reuse round (N = 10, 20) on Qwen3-30B-A3B's shape, full, prefix and collective;
#     moe-align: the grouping step in a sort and two launches against the torch ops, alone, in the
#     layer (bench/moe.py --align) and in the reuse round at N = 10 (the torch ops patched back in)
#   remote: the proxy over `tokendance engine` against the engine in-process (bench/remote.py),
#     a Qwen2.5-0.5B shape with random weights saved as a folder (the servers load folders)
#   structured: structured outputs against the same work unconstrained (bench/structured.py),
#     and tools: rounds of tool-calling agents through the proxy in each mode (bench/tools.py;
#     with the host tier and without),
#     both on a Qwen2.5-7B shape with random weights and the tokenizer's vocabulary, saved as a folder
# The carried folders are git-ignored; make them once on the CPU machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl structlog aiohttp msgspec aiomqtt paho-mqtt \
#     pytest-asyncio==1.5.0  # the interleavings' asyncio test (the GPU host has pytest 9.1); paho-mqtt: the
#     CLI's serve imports it (without it a CLI test fails there)
#   (structured, tools, and check's held-after-a-marker check: also xgrammar apache-tvm-ffi openai httpx2 httpcore2 anyio pydantic
#   pydantic_core annotated-types typing-inspection distro jiter sniffio truststore idna h11,
#   with --platform manylinux_2_28_x86_64 and the versions .venv has)
#   (then delete .whl/typing_extensions-*: the GPU host's own must stay)
#   mkdir -p .device/tok && cp ~/.cache/tokendance/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .device/tok/
# The package is not installed there: a namespace folder links our folders in.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/td/tokendance
for d in backend kernels proxy adapters bench examples; do ln -sfn "$PWD/$d" "/tmp/td/tokendance/$d"; done
export PYTHONPATH=/tmp/td:/tmp/site PYTHONUNBUFFERED=1
export TOKENDANCE_TOKENIZER="$PWD/.device/tok" TOKENDANCE_CACHE=/tmp/tdcache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# TD_LIMIT=N td ...: the CLI stopped after N seconds (a function can't be wrapped by `timeout`)
td() { timeout "${TD_LIMIT:-600}" python3 -c "import sys; from tokendance.examples.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
what=" ${*:-all} "
want() { [[ "$what" == *" all "* || "$what" == *" $1 "* ]]; }
if want engine || want check; then
  python3 -m tokendance.bench.check_cuda 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/check.txt"
  python3 -m tokendance.bench.check_cuda memory 2>&1 | grep -i "utilization\|budget" | tee -a "$OUT/check.txt"
  # The GPU-only tests (skipped on the CPU machine), the kernels' apart: their conftest turns
  # on Triton's interpreter for the whole process. Then the engine's random interleavings on
  # CUDA, through the Triton kernels, head dim 32 and 16 (halves padded to 16) (their tiny models
  # take the tokenizer from TOKENDANCE_TOKENIZER).
  for t in tests/kernels/test_prefill.py "tests/backend/test_upload.py tests/backend/test_arena.py" \
      "tests/backend/test_chaos.py -k cuda"; do
    python3 -m pytest -q -p no:cacheprovider -rfEs $t 2>&1 | tail -4
  done | tee "$OUT/gpu_tests.txt"
fi
if want tests; then
  # A file per process: a device-side assert poisons the CUDA context for the rest of its
  # process, and would fail every later file too. Each file's whole output stays in $OUT.
  for t in greedy_vs_hf reuse mirror idle lookahead priority kvcomm offload bases late sampling windows gemma3 gemma2 \
      phi3 kv_dtype; do
    python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/backend/test_$t.py >"$OUT/test_$t.txt" 2>&1
    echo "test_$t: $(tail -1 "$OUT/test_$t.txt")"
  done | tee "$OUT/backend_tests.txt"
fi
if want kv-dtype; then
  td bench kv-dtype --model qwen2.5-7b --dtype bfloat16 --questions 0 --decode 32x4096,64x2048 --steps 32 \
    --repeats 3 --kv-tokens 140000 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/kv_dtype.txt"
  timeout 560 python3 bench/kernels.py --decode --fp8 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/sweep_fp8.txt"
  for f in "" --fp8; do
    timeout 240 python3 bench/collective.py $f 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/collective$f.txt"
  done
  python3 -c "from tokendance.bench.check_cuda import greedy_vs_hf
greedy_vs_hf('float32', 'phi-3.5-mini', 2, 5000); greedy_vs_hf('bfloat16', 'phi-3.5-mini', 2, 5000)" 2>&1 \
    | grep -v -i "warn\|deprecat\|info \|original_max" | tee "$OUT/phi_greedy.txt"
fi
if want fp8-decode; then
  timeout 240 python3 bench/fp8_decode.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/fp8_decode.txt"
  for f in "" --fp8; do
    timeout 150 python3 bench/collective.py $f 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/collective$f.txt"
  done
fi
if want fp8-step; then
  td bench kv-dtype --model qwen2.5-7b --dtype bfloat16 --questions 0 --decode 32x4096 --steps 32 \
    --repeats 3 --kv-tokens 140000 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/kv_dtype.txt"
fi
if want quant; then
  python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/backend/test_quantization.py >"$OUT/quant_tests.txt" 2>&1
  tail -4 "$OUT/quant_tests.txt"
  python3 -m tokendance.bench.check_quant 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/check_quant.txt"
  timeout 300 python3 bench/fp8_linear.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/fp8_linear.txt"
  td bench kv-dtype --model qwen2.5-7b --dtype bfloat16 --questions 0 --kv auto --quantization fp8 \
    --prefill 10x2048 --decode 1x1024,8x1024,32x4096 --steps 32 --repeats 3 --kv-tokens 140000 2>&1 \
    | grep -v -i "warn\|deprecat\|info " | tee "$OUT/quant.txt"
fi
if want fp8-load; then
  python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/backend/test_fp8_checkpoints.py \
    tests/backend/test_quantization.py tests/backend/test_loading.py >"$OUT/fp8_load_tests.txt" 2>&1
  tail -4 "$OUT/fp8_load_tests.txt"
  python3 -m tokendance.bench.check_quant 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/check_quant.txt"
fi
if want fp8-block; then
  python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/backend/test_fp8_blocks.py \
    >"$OUT/fp8_block_tests.txt" 2>&1
  tail -4 "$OUT/fp8_block_tests.txt"
  timeout 300 python3 bench/fp8_block.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/fp8_block.txt"
fi
if want fp8-block-sweep; then
  timeout 500 python3 bench/fp8_block.py --sweep ${BLOCK_ROWS:+--rows "$BLOCK_ROWS"} 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/fp8_block_sweep.txt"
fi
if want fp8-block-engine; then
  [ -f /tmp/q7-block/config.json ] || { python3 -c "import sys; from pathlib import Path
from tokendance.bench.shapes import save_random; save_random('qwen2.5-7b', Path(sys.argv[1]))" /tmp/q7 && \
    td quantize /tmp/q7 /tmp/q7-rows && td quantize /tmp/q7 /tmp/q7-block --block 128 || exit 1; }
  for w in block rows; do
    td bench kv-dtype --model /tmp/q7 --dtype bfloat16 --questions 0 --kv auto --weights /tmp/q7-$w \
      --prefill 10x2048 --decode 1x1024,8x1024,32x4096 --steps 32 --repeats 3 --kv-tokens 140000 2>&1 \
      | grep -v -i "warn\|deprecat\|info " | tee "$OUT/fp8_block_engine_$w.txt"
  done
fi
if want speculate; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rfEs tests/backend/test_speculate.py \
    >"$OUT/speculate_tests.txt" 2>&1
  tail -4 "$OUT/speculate_tests.txt"
  TD_LIMIT=300 td bench speculate --model qwen2.5-7b --dtype bfloat16 --no-debate --cost 1x2048,8x2048,32x2048 \
    --tokens 4 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/speculate.txt"
fi
if want load; then
  timeout 540 python3 -m tokendance.bench.fp8_load --model qwen2.5-7b --dtype bfloat16 --repeats 3 \
    --work /tmp/fp8load ${LOAD_BASELINE:+--baseline "$LOAD_BASELINE"} 2>&1 \
    | grep -v -i "warn\|deprecat\|info " | tee "$OUT/fp8_load.txt"
fi
if want scoring; then
  python3 -m tokendance.bench.scoring --model qwen2.5-7b --dtype bfloat16 --tokens 2048 --prompts 8 \
    --repeats 5 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/scoring.txt"
fi
if want embed; then
  python3 -m tokendance.bench.embed --model qwen2.5-7b --dtype bfloat16 --inputs 64 --tokens 16,512 --batch 32 \
    --repeats 5 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/embed.txt"
fi
if want act; then
  python3 -m tokendance.bench.check_cuda act 2>&1 | tee "$OUT/act.txt"
fi
if want prefill; then
  td bench engine --model qwen2.5-7b --dtype bfloat16 --prefill 10x2048 --decode "" --repeats 3 \
    2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/prefill.txt"
fi
if want engine; then
  td bench engine --model qwen2.5-7b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 \
    --steps 48 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/engine.txt"
fi
if want qwen3; then
  td bench engine --model qwen3-8b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 \
    --steps 48 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/qwen3.txt"
fi
if want qwen3-reuse; then
  td bench reuse --model qwen3-8b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --modes full,prefix,collective 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/qwen3_reuse.txt"
fi
if want readers; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --ratio 0.3 --modes full,collective --readers collective 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/readers.txt"
  # and its capacity: round latency with 128 decoded tokens per agent (as `capacity`)
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 12,14,16,18,20 --history 512 --output 150 \
    --repeats 3 --decode 128 --ratio 0.3 --modes collective --readers collective 2>&1 \
    | grep -v -i "warn\|deprecat" | tee "$OUT/readers_capacity.txt"
fi
if want headdims; then
  python3 -m tokendance.bench.head_dims ${HEADDIMS_BASELINE:+--baseline "$HEADDIMS_BASELINE"} 2>&1 \
    | grep -v -i "warn\|deprecat" | tee "$OUT/head_dims.txt"
fi
if want headdims-engine; then
  td bench engine --model danube3-4b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 \
    --steps 48 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/head_dims_engine.txt"
  # as before session 50: head dims other than powers of two from 32 ran the references, no graphs
  python3 -c "import sys, tokendance.kernels.jit as j; j.tiles_head = lambda d: j.HAVE_TRITON and d >= 32 \
and d & (d - 1) == 0; from tokendance.examples.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench engine --model danube3-4b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 --steps 48 \
    --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/head_dims_engine_before.txt"
fi
if want windows; then
  python3 bench/windows.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/windows.txt"
  python3 -c "from tokendance.bench.check_cuda import greedy_vs_hf
greedy_vs_hf('float32', 'gemma-3-1b', 6, 1500); greedy_vs_hf('bfloat16', 'gemma-3-1b', 6, 1500)
greedy_vs_hf('float32', 'mistral-7b-v0.1', 2, 5000)" 2>&1 | grep -v -i "warn\|deprecat\|info " | tee "$OUT/windows_greedy.txt"
  td bench engine --model gemma-3-1b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 --steps 48 \
    --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/gemma_engine.txt"
  td bench engine --model mistral-7b-v0.1 --dtype bfloat16 --prefill 2x8192 --decode 16x8192 --steps 32 \
    --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/windows_engine.txt"
fi
if want gemma2; then
  python3 bench/softcap.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/softcap.txt"
  python3 -c "from tokendance.bench.check_cuda import greedy_vs_hf
greedy_vs_hf('float32', 'gemma-2-2b', 4, 5000); greedy_vs_hf('bfloat16', 'gemma-2-2b', 4, 5000)" 2>&1 \
    | grep -v -i "warn\|deprecat\|info " | tee "$OUT/gemma2_greedy.txt"
  td bench engine --model gemma-2-2b --dtype bfloat16 --prefill 4x2048 --decode 32x4096 --steps 48 \
    --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/gemma2_engine.txt"
fi
if want smollm3; then
  python3 -c "import sys; from tokendance.bench.check_cuda import greedy_vs_hf, graphs_vs_eager
ok = greedy_vs_hf('float32', 'smollm3-3b', 4); greedy_vs_hf('bfloat16', 'smollm3-3b', 4)
err = graphs_vs_eager(shape='smollm3-3b'); print(f'CUDA-graph decode vs eager (smollm3-3b), bf16: {err:.2e}')
sys.exit(0 if ok and err < 2e-2 else 1)" 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/smollm3.txt"
  td bench engine --model smollm3-3b --dtype bfloat16 --prefill 10x2048 --decode 32x4096 \
    --steps 48 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/smollm3_engine.txt"
fi
if want moe; then
  python3 bench/moe.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/moe_kernel.txt"
  python3 -c "import sys; from tokendance.bench.check_cuda import greedy_vs_hf, graphs_vs_eager
ok = [greedy_vs_hf(d, s, 4) for s in ('olmoe-1b-7b', 'qwen3-30b-a3b') for d in ('float32', 'bfloat16')]
err = graphs_vs_eager(shape='qwen3-30b-a3b'); print(f'CUDA-graph decode vs eager (qwen3-30b-a3b), bf16: {err:.2e}')
sys.exit(0 if ok[0] and ok[2] and err < 2e-2 else 1)" 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/moe.txt"
fi
if want moe || want moe-engine; then
  td bench engine --model olmoe-1b-7b --dtype bfloat16 --prefill 10x2048 --decode 32x2048 \
    --steps 48 --repeats 3 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/moe_engine.txt"
fi
if want moe-sweep; then
  python3 bench/moe.py --sweep 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/moe_sweep.txt"
fi
if want moe-reuse; then
  td bench reuse --model qwen3-30b-a3b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --modes full,prefix,collective 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/moe_reuse.txt"
fi
if want moe-align; then
  python3 bench/moe.py --align --tokens 1,256,2048 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/moe_align.txt"
  for a in m.align_reference m.align; do
    python3 -c "import sys, tokendance.kernels.moe as m; m.align = $a
from tokendance.examples.cli import main; sys.exit(main(sys.argv[1:]))" bench reuse --model qwen3-30b-a3b \
      --dtype bfloat16 --agents 10 --history 512 --output 150 --repeats 3 --modes full,collective 2>&1 \
      | grep -v -i "warn\|deprecat" | tee -a "$OUT/moe_align.txt"
  done
fi
if want mirrors; then
  python3 -m tokendance.bench.check_cuda mirrors 2>&1 | grep -i "mirror\|diff encode" | tee "$OUT/check_mirrors.txt"
fi
if want collective; then
  timeout 240 python3 bench/collective.py 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/collective.txt"
fi
if want reuse; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --serial pic --readers collective --profile 14 --json "$OUT/reuse.json" 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/reuse.txt"
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10 --history 512 --output 150 \
    --repeats 3 --ratio 0.05 --modes pic,collective --serial pic 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/reuse_r05.txt"
fi
if want gaps; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10 --history 512 --output 150 \
    --repeats 3 --modes full,pic,collective --profile 5 --trace "$OUT" \
    2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/gaps_reuse.txt"
  td bench gaps "$OUT"/*-n10.json.gz | tee "$OUT/gaps.txt"
fi
if want policy; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --ratio 0.045 --modes full,pic,collective --json "$OUT/policy.json" \
    2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/policy.txt"
fi
if want capacity; then
  # Capacity: round latency (prefill + 128 tokens per agent) against the 1500 ms SLO.
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 2,4,8,10,12,14,16,20,32 --history 512 \
    --output 150 --repeats 1 --decode 128 --modes prefix,collective \
    --json "$OUT/capacity.json" 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/capacity.txt"
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 8,10,12,14,16,20 --history 512 \
    --output 150 --repeats 1 --decode 128 --modes collective --ratio 0.045 \
    --json "$OUT/capacity_policy.json" 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/capacity_policy.txt"
fi
if want kvcomm; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --modes full,prefix,pic,collective,kvcomm --serial pic 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/kvcomm_reuse.txt"
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 12,16,20,24 --history 512 --output 150 \
    --repeats 1 --decode 128 --modes prefix,collective,kvcomm 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/kvcomm_capacity.txt"
fi
if want kvcmas; then
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --modes full,collective,kvcomm,kvcmas 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/kvcmas_reuse.txt"
  td bench resume --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --answer 128 --repeats 3 --variants kvcmas,kvcomm,resumed 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/kvcmas_resume.txt"
fi
if want fanout; then
  for nk in "10 10,5,2,1" "20 20,10,5,2,1"; do
    read -r n k <<< "$nk"
    td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents "$n" --fanout "$k" --history 512 --output 150 \
      --repeats 3 --modes full,collective,kvcomm --serial pic --readers collective 2>&1 \
      | grep -v -i "warn\|deprecat" | tee -a "$OUT/fanout.txt"
  done
fi
if want bounds; then
  # What the goals' workload allows at all: the round with nothing recomputed (r = 0),
  # then capacity (128 decoded tokens per agent) at r = 0 beside prefix and r = 15 %.
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --repeats 3 --ratio 0 --modes full,collective --serial pic 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/bounds_reuse.txt"
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 12,14,22,24 --history 512 --output 150 \
    --repeats 3 --decode 128 --modes prefix,collective 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/bounds_capacity.txt"
  td bench reuse --model qwen2.5-7b --dtype bfloat16 --agents 28,32,36,40,48 --history 512 --output 150 \
    --repeats 2 --decode 128 --modes collective --ratio 0 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/bounds_capacity_r0.txt"
fi
if want mirror-decode; then
  td bench mirror-decode --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --steps 32 \
    2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/mirror_decode.txt"
fi
if want restore; then
  td bench restore --shape qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --ratio 0.15,0.05 --generated 128 --repeats 5 --json "$OUT/restore.json" \
    2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/restore.txt"
fi
if want sweep; then
  timeout 420 python3 bench/kernels.py --decode 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/sweep.txt"
fi
if want steps; then
  td bench engine --model qwen2.5-7b --dtype bfloat16 --prefill "" --decode 32x4096 --steps 48 \
    --repeats 1 --breakdown 2>&1 | grep -v -i "warn\|deprecat\|forward_call" | tee "$OUT/steps.txt"
fi
if want resume; then
  td bench resume --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --answer 128 --repeats 3 --variants resumed,without,prefix,kvcomm 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/resume.txt"
  # and in the 1 GiB host tier that was the default until session 37
  td bench resume --model qwen2.5-7b --dtype bfloat16 --agents 10,20 --history 512 --output 150 \
    --answer 128 --repeats 3 --variants resumed,kvcomm --offload-gib 1 2>&1 | grep -v -i "warn\|deprecat" \
    | tee -a "$OUT/resume.txt"
fi
if want remote; then
  python3 -m tokendance.bench.shapes qwen2.5-0.5b /tmp/qwen2.5-0.5b-random >/dev/null &&
    td bench remote --model /tmp/qwen2.5-0.5b-random --dtype bfloat16 --repeats 20 2>&1 \
    | grep "^|" | tee "$OUT/remote.txt"
fi
if want fleet; then
  # one engine per GPU (a machine of two or more: nvidia-h200-x2 and up); on one GPU, two
  # engines share it (each with a pool of its own), against one engine on it
  gpus=$(nvidia-smi -L | wc -l)
  python3 -m tokendance.bench.shapes qwen2.5-0.5b /tmp/qwen2.5-0.5b-random >/dev/null
  if [ "$gpus" -ge 2 ]; then pin=(--pin gpu --engines "$gpus"); else pin=(--engines 2 --kv-tokens 400000); fi
  td bench fleet --model /tmp/qwen2.5-0.5b-random --dtype bfloat16 "${pin[@]}" --sessions 8 --agents 10 \
    --rounds 3 --history 400 --output 64 --repeats 3 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/fleet.txt"
fi
if want parallel || want check; then  # two ranks on one GPU give one process's tokens
  python3 -m tokendance.bench.check_parallel 2>&1 | grep -v -i "warn\|deprecat\|\[info\|\[debug" \
    | tee "$OUT/check_parallel.txt"
fi
if want parallel && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  gpus=$(nvidia-smi -L | wc -l)
  sizes=1; for n in 2 4 8; do [ "$gpus" -ge $n ] && sizes="$sizes,$n"; done
  td bench parallel --model qwen2.5-0.5b --sizes "$sizes" --prefill 4x512 --decode 8x512 --steps 8 \
    --agents 4 --repeats 1 2>&1 | grep -v -i "warn\|deprecat" | tee "$OUT/parallel-small.txt"
  td bench parallel --model qwen2.5-14b --sizes "$sizes" --repeats 3 2>&1 | grep -v -i "warn\|deprecat" \
    | tee "$OUT/parallel.txt"
  # a follower killed mid-step over NCCL: how long until the leader's step fails, or its
  # watchdog ends it (then no line)
  timeout 400 python3 -m tokendance.bench.check_parallel --death 2>&1 | tail -n 40 | tee "$OUT/death.txt"
fi
if want structured || want tools; then
  # the tokenizer's vocabulary: a mask over 100 k ids no token has costs what no real model's does
  [ -d /tmp/qwen2.5-7b-v49k ] || python3 -m tokendance.bench.shapes qwen2.5-7b /tmp/qwen2.5-7b-v49k \
    --tokenizer-vocab >/dev/null
fi
if want structured; then
  td bench structured --model /tmp/qwen2.5-7b-v49k --dtype bfloat16 --batch 1,8,32 --repeats 5 2>&1 \
    | grep -v -i "warn\|deprecat\|info " | tee "$OUT/structured.txt"
fi
if want tools; then  # then without the host tier: nothing parked between a turn's two requests
  for gib in 1 0; do
    td bench tools --model /tmp/qwen2.5-7b-v49k --dtype bfloat16 --agents 4,8,16 --rounds 2 --repeats 3 \
      --offload-gib $gib 2>&1 | grep -v -i "warn\|deprecat\|info \|debug " | tee "$OUT/tools-$gib.txt"
  done
fi
