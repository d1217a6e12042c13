"""The per-round table of `tokendance simulate`, and where two runs first diverged."""

from __future__ import annotations

from typing import Any

from tokendance.examples.loop import Round

COLUMNS = ("round", "agents", "groups", "prompt tok", "shared tok", "reused %", "KV held/dense", "latency")


def _sum(r: Round, key: str) -> int:
    """`key` summed over the replies' usage (its details and extension included)."""
    total = 0
    for rep in r.replies.values():
        u = rep.usage
        flat = {**u, **(u.get("prompt_tokens_details") or {}), **(u.get("tokendance") or {})}
        total += int(flat.get(key) or 0)
    return total


def _get(stats: dict[str, Any], r: Round, key: str, usage_key: str | None = None) -> int:
    """`key` from the proxy's round stats, else summed over the replies' usage."""
    if isinstance(stats.get(key), (int, float)):
        return int(stats[key])
    return _sum(r, usage_key or key)


def row(r: Round) -> dict[str, Any]:
    s = r.stats
    prompt = _get(s, r, "prompt_tokens")
    shared = _get(s, r, "shared_tokens")
    reused = _get(s, r, "reused_tokens", "cached_tokens")
    held = _get(s, r, "kv_held_bytes") + int(s.get("kv_shared_bytes") or 0)  # the Masters once
    dense = _get(s, r, "kv_dense_bytes")
    groups = s.get("groups")
    return {
        "round": r.round,
        "agents": len(r.replies),
        "groups": len(groups) if isinstance(groups, list) else groups if groups is not None else "-",
        "prompt tok": prompt,
        "shared tok": shared,
        "reused %": f"{100 * reused / prompt:.1f}" if prompt else "-",
        "KV held/dense": f"{size(held)} / {size(dense)} ({held / dense:.0%})" if dense else "-",
        "latency": f"{r.latency * 1000:.0f} ms",
    }


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def render(rounds: list[Round], title: str) -> str:
    rows = [{c: c for c in COLUMNS}, *(row(r) for r in rounds)]
    width = {c: max(len(str(x[c])) for x in rows) for c in COLUMNS}
    return "\n".join([title, *("  ".join(str(x[c]).rjust(width[c]) for c in COLUMNS) for x in rows)])


def _word(words: list[str], i: int) -> str:
    return repr(words[i]) if i < len(words) else "(end)"


def diverged(base: list[Round], other: list[Round]) -> str:
    """Where `other`'s outputs first differ from `base`'s (round, agent, word)."""
    for a, b in zip(base, other):
        for agent, rep in a.replies.items():
            x, y = rep.text.split(), b.replies[agent].text.split()
            if x != y:
                i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                return (f"outputs first diverged in round {a.round}, agent {agent}, "
                        f"word {i + 1}: {_word(x, i)} vs {_word(y, i)}")
    return f"outputs identical in all {min(len(base), len(other))} rounds"
