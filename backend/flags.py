"""The engine's command-line flags, shared by `tokendance serve` (the proxy with the
engine in-process), `tokendance engine` (the engine alone, for a remote proxy) and
`simulate`'s in-process engine."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from tokendance.backend import generation
from tokendance.backend.api import BASES, KV_DTYPES, POLICIES, QUANTIZATIONS, REUSE_DEFAULTS
from tokendance.backend.ngram import Speculation


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, its dtype, the reuse policy and the host tier."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `serve MODEL` takes it (or --model)")
    p.add_argument("--model", default=None, help="HF folder, GGUF file or a hub id in the Hugging Face cache "
                                                 "(default: embedded SmolLM2)")
    add_source_args(p)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                   help="the KV pool's: auto (the model's dtype) or 8-bit floats (fp8 = fp8_e4m3; "
                        "half a bf16 pool's bytes a token)")
    add_parallel_args(p)
    p.add_argument("--seed", type=int, default=0,
                   help="the engine's random seed: requests sampled without their own seed draw from it")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every decode step eagerly (no CUDA graphs)")
    add_reuse_args(p)
    p.add_argument("--offload-gib", type=float, default=None,
                   help="host memory for idle agents' KV between their rounds (0: off; default 8 GiB "
                        "beside a GPU, or an eighth of the host's memory if less, shared by -dp's engines; 1 GiB "
                        "on a CPU)")
    p.add_argument("--swap-space", dest="offload_gib", type=float, metavar="GIB",
                   help="vLLM's host memory for KV (its preempted requests'): here --offload-gib's, for idle "
                        "agents' KV")
    p.add_argument("--anchor-gib", type=float, default=1.0,
                   help="kvcomm and kvcmas: memory for their anchors (a measured segment's base and "
                        "offset K/V), on the engine's device beside the KV pool")
    p.add_argument("--anchor-rank", type=int, default=32,
                   help="kvcmas: the rank its anchors are held at, per layer (KVCMAS's low-rank anchors)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=16,
                   help="tokens a block of the KV pool holds: the unit the pool, the prefix cache "
                        "and the host tier allocate and move (a Mirror's patches are single tokens)")
    p.add_argument("--kv-tokens", type=at_least(0, units=True), default=0,
                   help="the KV pool's size in tokens (0: 16 k on the CPU, 85 %% of the GPU's memory "
                        "left free by the weights)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0, metavar="F",
                   help="the share of the GPU's memory this engine holds: weights, a step's peak "
                        "(measured at start) and the KV pool (0: as --kv-tokens says)")
    p.add_argument("--kv-cache-memory-bytes", type=at_least(0, units=True), default=0, metavar="BYTES",
                   help="the KV pool's size in bytes, as 8G (vLLM's; in place of the two above)")
    p.add_argument("--num-gpu-blocks-override", type=at_least(0), default=0, metavar="N",
                   help="the KV pool's size in blocks of --block-size tokens (vLLM's, for testing preemption)")
    p.add_argument("--max-model-len", type=model_len, default=0,
                   help="the longest prompt and answer together (0, or vLLM's auto and -1: the model's "
                        "limit, or the pool's where that is less)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=256, help="requests running at once")
    p.add_argument("--max-logprobs", type=at_least(-1), default=20,
                   help="the most alternatives a token's logprobs may list (top_logprobs, a completion's "
                        "logprobs, prompt_logprobs; -1: any, up to the vocabulary)")
    p.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="fcfs: first come, first served; priority: by each request's priority (lower "
                        "first, then arrival), a waiting request preempting running ones of lower priority")
    p.add_argument("--max-num-batched-tokens", type=at_least(0, units=True), default=0,
                   help="tokens a step computes at most (0: 2,048 on the CPU, 16,384 on the GPU)")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='n-gram speculation, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\': each decoding request drafts the '
                        "tokens that followed its last ones earlier in its prompt and output, checked in one step")
    add_generation_args(p)


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # of vLLM's --load-format choices


def add_source_args(p: argparse.ArgumentParser) -> None:
    """Where the model, its config and its tokenizer come from (MODEL or --model aside), and
    how its weights are held."""
    p.add_argument("--tokenizer", default=None, metavar="FOLDER|ID",
                   help="serve the model with this folder's (or cached hub model's) tokenizer and chat "
                        "template (vLLM's: for a GGUF, its original model's; default: the model's own; "
                        "with serve --vllm, the vLLM server's model)")
    p.add_argument("--hf-config-path", default=None, metavar="FOLDER|ID",
                   help="the model as this folder's config.json (and generation_config.json) describe it "
                        "(vLLM's: for a GGUF, its original model's folder, with what no GGUF carries, such "
                        "as a sliding window; default: the model's own)")
    p.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="fields set over the model's config.json, each whole (vLLM's), e.g. a longer context: "
                        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
                        '"original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}\'')
    p.add_argument("--trust-remote-code", action="store_true",
                   help="load a tokenizer whose class is Python code in its folder (vLLM's; the model "
                        "itself is always one of the architectures this engine implements)")
    p.add_argument("--revision", default=None,
                   help="a hub model's branch, tag or commit in the cache (vLLM's; default: main)")
    p.add_argument("--tokenizer-revision", default=None,
                   help="the tokenizer's, where --tokenizer is a hub model (default: --revision)")
    p.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache hub models are found in (vLLM's; default: HF_HUB_CACHE, "
                        "~/.cache/huggingface/hub); nothing is downloaded")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="the weights: as the model is (auto), a folder's safetensors, a .gguf file, or "
                        "random ones (dummy: vLLM's, for timing; config.json and a tokenizer are enough)")
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="fp8: each layer's projections held in e4m3, a scale per row, inputs rounded per "
                        "token (half a bf16 weight's bytes; FP8 tensor cores from compute capability 9.0, "
                        "elsewhere the weights widened on each call: memory, not time); a checkpoint "
                        "stored in 8 bits (fp8, compressed-tensors) is read as it is, without the flag")


def source_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's fields from `add_source_args`' flags and the model (ValueError where
    --load-format is not the model's)."""
    name = model(args)
    gguf = str(name).endswith(".gguf")
    if args.load_format == "gguf" and not gguf and name not in (None, "", "default"):  # the default is one
        raise ValueError(f"--load-format gguf: the model {name} is not a .gguf file")
    if args.load_format == "safetensors" and gguf:
        raise ValueError(f"--load-format safetensors: the model {name} is a .gguf file")
    return {"model": name, "tokenizer": args.tokenizer, "hf_config_path": args.hf_config_path,
            "hf_overrides": args.hf_overrides or {}, "trust_remote_code": args.trust_remote_code,
            "revision": args.revision, "tokenizer_revision": args.tokenizer_revision,
            "download_dir": args.download_dir, "random_weights": args.load_format == "dummy",
            "quantization": args.quantization}


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """vLLM's tensor parallelism flag (backend/parallel.py)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=at_least(1), default=1,
                   help="split each layer over this many GPUs (processes on the CPU), from the "
                        "engine's device on; the model's heads and MLP width must divide by it")


BLOCK_SIZES = (1, 8, 16, 32, 64, 128)  # vLLM's --block-size choices
# engine flags that serve --vllm takes too: the proxy tokenizes and samples for a vLLM server by them
VLLM_TOO = ("--tokenizer", "--generation-config", "--override-generation-config", "--trust-remote-code",
            "--revision", "--tokenizer-revision", "--download-dir")
# engine flags that serve --engine takes too: the proxy loads the engine's tokenizer by it
ENGINE_TOO = ("--trust-remote-code",)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the default sampling (backend/generation.py)."""
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="where a request's sampling defaults come from: the model folder's "
                        "generation_config.json (auto), none (vllm), or another folder's")
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help='sampling defaults over those, e.g. \'{"temperature": 0.5}\' (temperature, '
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens)")


def json_object(text: str) -> dict[str, Any]:
    """A JSON object option (argparse `type=`)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_reuse_args(p: argparse.ArgumentParser) -> None:
    """The engine's reuse policy."""
    p.add_argument("--recompute-ratio", type=float, default=REUSE_DEFAULTS["recompute_ratio"],
                   help="pic / collective: share of each request's reused tokens recomputed, at most")
    p.add_argument("--recompute-floor", type=float, default=REUSE_DEFAULTS["recompute_floor"],
                   help="pic / collective: of those, only tokens whose KV deviation at the check "
                        "layer exceeds this (0: all of them; docs/fidelity.md)")
    p.add_argument("--bases", choices=BASES, default=REUSE_DEFAULTS["bases"],
                   help="pic / collective: a shared segment's base KV prefilled standalone once per "
                        "round; its producer's own KV of it (no prefill; lower fidelity on SmolLM2); "
                        "or its KV in a reader's context (two requests of a round prefilled in full, "
                        "more where prompts quote only some outputs, as in a chain of agents; "
                        "closer to exact prefill; with --recompute-ratio 0.3 half of SmolLM2's "
                        "debates stay identical to it at 4 and 8 agents; docs/fidelity.md)")
    p.add_argument("--min-shared-tokens", type=at_least(0), default=REUSE_DEFAULTS["min_shared_tokens"],
                   help="pic / collective: shared segments shorter than this are computed as the "
                        "request's own tokens (default: 64 on CUDA, where reusing 32-token ones made "
                        "rounds slower; 0 on the CPU)")


def at_least(low: int, units: bool = False) -> Callable[[str], int]:
    """An integer option of at least `low` (argparse `type=`: a bad value is a one-line
    usage error); with `units`, a count of tokens as vLLM also takes one: 32k (32,000),
    25.6k, 32K (32,768)."""

    def parse(text: str) -> int:
        try:
            n = _count(text) if units else int(text)
        except ValueError:
            also = " (or as 32k, 25.6k, 32K)" if units else ""
            raise argparse.ArgumentTypeError(f"expected an integer{also}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    return parse


def model_len(text: str) -> int:
    """--max-model-len: a token count, or vLLM's `auto` (or -1), what fits: 0 here."""
    return 0 if text.strip() in ("auto", "-1") else at_least(0, units=True)(text)


_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG])")


def _count(text: str) -> int:
    """vLLM's human-readable integers: decimal units (k, m, g) take a fraction that makes
    a whole count, binary ones (K, M, G) a whole number; ValueError otherwise."""
    m = _COUNT.fullmatch(text.strip())
    if m is None:
        return int(text)
    number, unit = m.groups()
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1 or (unit.isupper() and "." in number):
        raise ValueError(text)
    return int(value)


def reuse_options(args: argparse.Namespace) -> dict[str, float | str]:
    """The engine config's reuse fields, from `add_reuse_args`' flags."""
    return {name: getattr(args, name) for name in REUSE_DEFAULTS}


def changed(args: argparse.Namespace) -> list[str]:
    """The engine flags given other than their defaults, as written on the command line."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return ["MODEL" if k == "model_tag" else f"--{k.replace('_', '-')}"
            for k, v in vars(p.parse_args([])).items() if getattr(args, k) != v]


def model(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or --model (ValueError if both name different ones)."""
    tag = getattr(args, "model_tag", None)  # generate takes --model alone
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"MODEL {tag} and --model {args.model} name two models: give one")
    return tag or args.model


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's fields from `add_engine_args`' flags (ValueError for a bad one)."""
    for flag in ("offload_gib", "anchor_gib"):
        if getattr(args, flag) is not None and not 0 <= getattr(args, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number, not negative")
    if args.anchor_rank < 1:
        raise ValueError("--anchor-rank must be at least 1")
    if not 0 <= args.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must lie in (0, 1]")
    sizes = [f for f in ("--kv-tokens", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
                         "--num-gpu-blocks-override") if getattr(args, f[2:].replace("-", "_"))]
    if len(sizes) > 1:
        raise ValueError(f"{' and '.join(sizes)}: each sizes the KV pool, give one")
    generation.check(args.generation_config, args.override_generation_config)
    Speculation.parse(args.speculative_config)  # before the model loads
    offload = None if args.offload_gib is None else int(args.offload_gib * 2**30)  # None: the device's default
    return {**source_options(args), "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
            "tensor_parallel_size": args.tensor_parallel_size, "block_size": args.block_size,
            "seed": args.seed, **({"cuda_graphs": 0} if args.enforce_eager else {}), "offload_bytes": offload,
            "anchor_bytes": int(args.anchor_gib * 2**30), "anchor_rank": args.anchor_rank,
            "kv_tokens": args.kv_tokens, "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "num_gpu_blocks_override": args.num_gpu_blocks_override,
            "max_model_len": args.max_model_len, "max_seqs": args.max_num_seqs, "max_logprobs": args.max_logprobs,
            "scheduling_policy": args.scheduling_policy, "speculative_config": args.speculative_config,
            "max_batched_tokens": args.max_num_batched_tokens, "generation_config": args.generation_config,
            "override_generation_config": args.override_generation_config or {}, **reuse_options(args)}
