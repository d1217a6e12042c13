"""`tokendance bench failover`: a round after the session's engine is killed, or while it
runs, against the same round with none lost."""

from __future__ import annotations

import re

from tokendance.bench import failover


def test_failover_bench_loses_an_engine_and_every_agent_still_gets_its_answer(bench, tiny_llama):
    out = bench(failover, "--model", str(tiny_llama), "--agents", "2", "--history", "20", "--output", "4",
                "--repeats", "1")
    assert "1 session x 2 agents x 2 rounds" in out
    rows = {m[1]: m.groups()[1:] for m in re.finditer(
        r"^\| (kept|lost|mid) \| (\d+) \(\d+\) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d)/1 \|$", out, re.M)}
    assert set(rows) == {"kept", "lost", "mid"}
    _, _, resent, errors, failed, same = rows["kept"]
    assert (resent, errors, failed, same) == ("0", "0", "0", "1")
    # The two requests went to the other engine, sent again by the fleet or routed there
    # by the proxy's poll; either way no agent saw an error, and the answers are the same.
    _, _, resent, errors, failed, same = rows["lost"]
    assert resent in ("0", "2") and (errors, failed, same) == ("0", "0", "1")
    # Killed while round 2 runs (a tiny model's round may be over by then): its requests
    # that were on it start again on the other engine, and no agent sees an error.
    _, _, resent, errors, failed, same = rows["mid"]
    assert (errors, failed, same) == ("0", "0", "1")
    assert re.search(r"^\| lost / kept \| [\d.]+x \|", out, re.M) and re.search(r"^\| mid / kept \| [\d.]+x \|", out, re.M)
