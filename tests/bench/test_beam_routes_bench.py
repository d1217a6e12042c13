"""bench/beam_routes.py runs a beam search through a fleet both ways and counts what the
steps computed: kept on one engine, they compute less than taking the engines in turn."""

from __future__ import annotations

import re

from tokendance.backend.fleet import Fleet
from tokendance.bench import beam_routes


def test_routed_steps_compute_less_than_steps_in_turn(tiny_llama, bench):
    route = Fleet.route
    out = bench(beam_routes, "--model", str(tiny_llama), "--width", "3", "--tokens", "6", "--repeats", "1")
    assert Fleet.route is route  # put back
    assert re.search(r"^beam width 3, 6 tokens, 2 engines", out, re.M), out
    rows = dict(re.findall(r"^  (one engine \(routed\)|engines in turn) +([\d,]+) prompt tokens computed", out, re.M))
    assert len(rows) == 2, out
    routed, turn = (int(rows[k].replace(",", "")) for k in ("one engine (routed)", "engines in turn"))
    assert 0 < routed < turn, out
