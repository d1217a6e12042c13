"""`tokendance bench KIND`: engine, reuse, memory, mirror-decode, fidelity, kv-dtype, offsets, restore,
resume, remote, fleet, failover, structured, tools, beams, judge, loops, speculate, gaps, parallel, priority."""

from __future__ import annotations

import argparse
import importlib

KINDS = {
    "engine": ("tokendance.bench.engine", "prefill and decode tokens/s against HF transformers"),
    "reuse": ("tokendance.bench.reuse", "an All-Gather round in every reuse mode"),
    "memory": ("tokendance.bench.memory", "resident memory while serving"),
    "mirror-decode": ("tokendance.bench.mirror_decode", "decode steps over N Mirrors against dense caches"),
    "fidelity": ("tokendance.bench.fidelity", "pic / collective against full: KV deviation, agreement, divergence"),
    "kv-dtype": ("tokendance.bench.kv_dtype", "an 8-bit KV pool against the model's dtype: agreement, decode steps"),
    "offsets": ("tokendance.bench.offsets", "kvcomm's predicted K/V against exact, by prediction rule"),
    "restore": ("tokendance.bench.restore", "restoring idle agents from the host tier: fused against dense"),
    "resume": ("tokendance.bench.resume", "a second round with its agents resumed from the host tier, against without"),
    "remote": ("tokendance.bench.remote", "the proxy over a remote engine against the engine in-process"),
    "fleet": ("tokendance.bench.fleet", "simulations side by side on several engines against one"),
    "failover": ("tokendance.bench.failover", "a round after the session's engine is lost, against none lost"),
    "structured": ("tokendance.bench.structured", "structured outputs (a JSON schema) against the same work unconstrained"),
    "tools": ("tokendance.bench.tools", "rounds of agents that call a tool and answer, in each reuse mode"),
    "beams": ("tokendance.bench.beams", "beam search through the proxy against HF's generate(num_beams=n)"),
    "beam-routes": ("tokendance.bench.beam_routes", "a beam search through a fleet: its steps on one engine, against in turn"),
    "judge": ("tokendance.bench.judge", "a judge scoring N answers: /generative_scoring against completions"),
    "loops": ("tokendance.bench.loops", "a debate with repetition detection against without"),
    "speculate": ("tokendance.bench.speculate", "a debate with n-gram speculation against without"),
    "gaps": ("tokendance.bench.gaps", "where the device waits on the host in a traced run (bench reuse --trace)"),
    "parallel": ("tokendance.bench.parallel", "the engine split over 1, 2, ... devices (tensor parallelism)"),
    "priority": ("tokendance.bench.priority", "an urgent request in a busy engine, fcfs against priority scheduling"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="measure TokenDance")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, (module, text) in KINDS.items():
        importlib.import_module(module).add_args(kinds.add_parser(name, help=text))


def main(args: argparse.Namespace) -> int:
    return importlib.import_module(KINDS[args.kind][0]).main(args)
