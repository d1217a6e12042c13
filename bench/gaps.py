"""Where the device waits on the host: the idle gaps of a profiled run and the host code
running during them.

Reads a chrome trace written by the torch profiler with Python stacks (`tokendance
bench reuse --profile TOP --trace DIR` writes one per mode) and prints the largest gaps
between device work (kernels, copies, memsets), from the first host event on, with the
innermost frame of our own code at each gap's middle, then the idle time per own
function, sampled across every gap.

    tokendance bench gaps TRACE.json.gz [--top 12] [--min-us 100]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from dataclasses import dataclass

DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}
FOREIGN = ("site-packages", "/lib/python", "<built-in", "torch/", "<frozen")
SAMPLE_US = 10.0


@dataclass(slots=True)
class Frame:
    name: str
    start: float
    end: float


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (ValueError, gzip.BadGzipFile) as e:  # not JSON, not UTF-8, not gzip: name the file
        raise ValueError(f"{path}: not a chrome trace ({e})") from e
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path}: not a chrome trace (no traceEvents)")
    return trace["traceEvents"]


def busy(events: list[dict]) -> list[tuple[float, float]]:
    """The union of device intervals, sorted, in µs."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in DEVICE)
    out: list[list[float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def idle(events: list[dict], spans: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """Gaps of at least min_us from the first host event to the last device one."""
    host = [e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")]
    t, out = min(host, default=spans[0][0]), []
    for a, b in spans:
        if a - t >= min_us:
            out.append((t, a))
        t = max(t, b)
    return out


def own_frames(events: list[dict]) -> list[Frame]:
    """Python frames of our own code (not the libraries'), on the host thread that ran most."""
    py = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    if not py:
        return []
    main = Counter(e["tid"] for e in py).most_common(1)[0][0]
    return sorted((Frame(e["name"], e["ts"], e["ts"] + e["dur"]) for e in py
                   if e["tid"] == main and not any(f in e["name"] for f in FOREIGN)),
                  key=lambda f: (f.start, -f.end))


def innermost(frames: list[Frame], points: list[float]) -> list[str | None]:
    """The innermost frame active at each of the sorted points. Frames nest, so a finished
    frame left below an active one is popped once everything above it has ended."""
    out, stack, i = [], [], 0
    for p in points:
        while i < len(frames) and frames[i].start <= p:
            stack.append(frames[i])
            i += 1
        while stack and stack[-1].end < p:
            stack.pop()
        out.append(stack[-1].name if stack else None)
    return out


def report(path: str, top: int, min_us: float) -> str:
    events = load(path)
    spans = busy(events)
    if not spans:
        return f"{path}: no device events"
    gaps = idle(events, spans, min_us)
    frames = own_frames(events)
    t0 = gaps[0][0] if gaps and gaps[0][0] < spans[0][0] else spans[0][0]
    total = spans[-1][1] - t0
    waiting = sum(b - a for a, b in gaps)
    lines = [f"{path}: {total / 1e3:.1f} ms from the first host event to the last device one, "
             f"device idle {waiting / 1e3:.1f} ms in {len(gaps)} gaps of >= {min_us:.0f} µs",
             "", "| at ms | idle ms | host code at its middle |", "|---|---|---|"]
    mids = innermost(frames, sorted((a + b) / 2 for a, b in gaps))
    at = dict(zip(sorted((a + b) / 2 for a, b in gaps), mids))
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        lines.append(f"| {(a - t0) / 1e3:.1f} | {(b - a) / 1e3:.2f} | {at[(a + b) / 2] or '-'} |")
    points = [a + SAMPLE_US * (k + 0.5) for a, b in gaps for k in range(int((b - a) // SAMPLE_US))]
    per = Counter(innermost(frames, points))
    lines += ["", "| host code (innermost own frame) | idle ms |", "|---|---|"]
    lines += [f"| {name or '- (no own frame)'} | {n * SAMPLE_US / 1e3:.2f} |" for name, n in per.most_common(top)]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", help="chrome traces (`bench reuse --profile N --trace DIR`)")
    p.add_argument("--top", type=int, default=12, help="gaps and functions listed")
    p.add_argument("--min-us", type=float, default=100.0, help="shortest gap counted")


def main(args: argparse.Namespace) -> int:
    print("\n\n".join(report(t, args.top, args.min_us) for t in args.traces))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
