"""Several engines behind one proxy (backend/fleet.py): a session's requests all go to
one engine, new sessions to the least loaded, a down engine's sessions move, and the
proxy answers while one engine serves."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import openai
import pytest

from tokendance.backend import fleet as fleet_module
from tokendance.backend.api import BackendError, Prepared, Request, SamplingParams, Segment, Unavailable
from tokendance.backend.fleet import ACTIVE, Fleet, Pin
from tokendance.backend.protocol import Gauge
from tokendance.backend.remote import RemoteBackend
from tokendance.examples import cli
from tokendance.proxy.segment import SEP
from tokendance.proxy.stats import Metrics
from tests.proxy.test_remote import served


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, session: str | None = None, tenant: str = "") -> Request:
    return Request(rid, [Segment(f"hello from {rid}")], SamplingParams(max_tokens=2), session=session,
                   tenant=tenant)


@pytest.fixture
def three(make_backend) -> tuple[Fleet, list[Any], Clock]:
    engines = [make_backend() for _ in range(3)]
    clock = Clock()
    return Fleet(engines, clock=clock), engines, clock


def test_a_session_stays_on_its_engine_and_new_ones_go_to_the_least_loaded(three):
    f, engines, _ = three
    for k in range(4):  # a session of four agents
        f.prepare(request(f"a{k}", "big"))
    f.prepare(request("b0", "small"))
    assert [f.route(request("x", s)) for s in ("big", "small")] == [0, 1]
    assert f.route(request("c0", "third")) == 2
    f.prepare(request("c1", "third"))
    f.prepare(request("c2", "third"))
    # weights 4, 1, 2 (route alone adds nothing): the next session takes engine 1
    assert f.route(request("d0", "fourth")) == 1
    assert [f.route(request("y", s)) for s in ("big", "small", "third")] == [0, 1, 2]


def test_two_tenants_sessions_of_one_name_are_two_sessions(three):
    f, _, _ = three
    for k in range(3):
        f.prepare(request(f"a{k}", "debate", tenant="key-a"))
    f.prepare(request("b0", "debate", tenant="key-b"))  # not key-a's session: the next engine
    assert f.loads() == ([3, 1, 0], [1, 1, 0])
    assert [f.route(request("x", "debate", tenant=t)) for t in ("key-a", "key-b", "key-c")] == [0, 1, 2]


def test_a_session_weighs_its_latest_round_while_active(three):
    f, _, clock = three
    for k in range(8):
        f.prepare(request(f"a{k}", "old"))
    f.prepare(request("b0", "new"))
    assert f.loads() == ([8, 1, 0], [1, 1, 0])
    old = request("a9", "old")
    old.round = 2
    f.prepare(old)  # its second round, of one request so far
    assert f.loads() == ([1, 1, 0], [1, 1, 0])
    clock.t += ACTIVE / 2
    f.prepare(request("b1", "new"))
    clock.t += ACTIVE / 2 + 1  # "old" idle for longer than ACTIVE: it weighs nothing
    assert f.loads() == ([0, 2, 0], [0, 1, 0])
    assert f.route(request("x", "next")) == 0  # ties go to the fewest sessions, then the first


def test_a_down_engine_takes_no_work_and_its_sessions_move(three):
    f, engines, _ = three
    f.prepare(request("a0", "s"))
    assert f.pins["", "s"].engine == 0
    engines[0].down = "on fire"
    assert f.route(request("n", "new")) == 1  # not the down one
    p = f.prepare(request("a1", "s"))
    assert f.pins["", "s"].engine in (1, 2) and p.request.id == "a1"
    streams = f.generate([p])
    assert len(streams) == 1 and engines[f.pins["", "s"].engine].groups[-1][0].id == "a1"
    assert f.problem() is None
    engines[1].down = engines[2].down = "gone"
    assert f.problem() == "no engine can serve: 0: on fire; 1: gone; 2: gone"
    engines[2].down = None
    assert f.problem() is None and f.route(request("a2", "s")) == 2


def test_generate_splits_a_group_by_engine_and_keeps_its_order(three):
    f, engines, _ = three
    f.pins.update({("", "s0"): Pin(0, 0.0), ("", "s1"): Pin(1, 0.0)})
    group = [f.prepare(r) for r in (request("a", "s1"), request("b", "s0"), request("c"), request("d", "s1"),
                                    request("e"))]
    streams = f.generate(group)
    assert [s.part.streams[s.k].p.request.id for s in streams] == ["a", "b", "c", "d", "e"]
    assert [r.id for r in engines[1].groups[-1]] == ["a", "d"]
    # one call's loose requests together, where the first of them was prepared (the first turn)
    assert [r.id for r in engines[0].groups[-1]] == ["b", "c", "e"] and not engines[2].groups


def test_requests_outside_sessions_take_the_engines_in_turn_where_they_were_prepared(make_backend):
    engines = [make_backend() for _ in range(2)]
    f = Fleet(engines)
    for k in range(4):  # plain chats, one call each
        f.generate([f.prepare(request(f"r{k}"))])
    assert [[g[0].id for g in e.groups] for e in engines] == [["r0", "r2"], ["r1", "r3"]]


def test_requests_of_one_route_stay_on_one_engine_while_it_serves(three, monkeypatch):
    """A route (a beam search's steps) takes its engine in turn once, then keeps it; per
    tenant; moved when that engine is down; the least recent routes forgotten first."""
    f, engines, _ = three
    def routed(rid: str, route: str, tenant: str = "") -> int:
        r = request(rid, tenant=tenant)
        r.route = route
        return f.route(r)
    assert [routed(f"a{k}", "beams-a") for k in range(4)] == [0, 0, 0, 0]
    assert f.route(request("loose")) == 1  # the turn goes on past the route's one
    assert routed("b0", "beams-b") == 2 and routed("a4", "beams-a") == 0
    assert routed("t0", "beams-a", tenant="k2") == 0  # its own route: the next turn (0 again)
    engines[0].down = "gone"
    moved = routed("a5", "beams-a")
    assert moved != 0 and routed("a6", "beams-a") == moved
    monkeypatch.setattr(fleet_module, "MAX_PINS", 2)
    routed("c0", "beams-c")
    assert list(f.routes) == [("", "beams-a"), ("", "beams-c")]


def test_a_request_that_moved_at_the_barrier_is_prepared_where_it_goes(three, monkeypatch):
    f, engines, _ = three
    p = f.prepare(request("a0", "s"))
    was = f.pins["", "s"].engine
    engines[was].down = "gone"
    seen: list[str] = []
    for e in engines:
        monkeypatch.setattr(e, "prepare", lambda r, inner=e.prepare: seen.append(r.id) or inner(r))
    [st] = f.generate([p])
    now = f.pins["", "s"].engine
    assert now != was and seen == ["a0"] and st.part.streams[st.k].p.request.id == "a0"
    assert engines[now].groups[-1][0].id == "a0" and not engines[was].groups


def test_engines_that_differ_are_refused(make_backend):
    with pytest.raises(BackendError, match="engines 0 and 1 do not serve the same model"):
        Fleet([make_backend(), make_backend(name="other")])
    with pytest.raises(ValueError):
        Fleet([])


def test_pins_are_bounded(three, monkeypatch):
    f, _, _ = three
    monkeypatch.setattr(fleet_module, "MAX_PINS", 3)
    for k in range(5):
        f.route(request(f"r{k}", f"s{k}"))
    assert list(f.pins) == [("", "s2"), ("", "s3"), ("", "s4")]


def test_gauges_are_labelled_by_engine(three):
    f, engines, _ = three
    engines[1].down = "gone"
    f.prepare(request("a", "s"))
    text = Metrics().render(f.gauges())
    assert "tokendance_engine_fleet_engines_up 2" in text
    assert 'tokendance_engine_fleet_sessions{engine="0"} 1' in text
    assert 'tokendance_engine_fleet_load{engine="0"} 1' in text
    assert 'tokendance_engine_groups{engine="2"} 0' in text
    assert text.count("# TYPE tokendance_engine_groups gauge") == 1
    assert Metrics().render([Gauge("x", "h", 1, labels={"engine": 'a"b\\c'})]).count('{engine="a\\"b\\\\c"}') == 1


def test_serve_refuses_an_engine_named_twice(capsys):
    assert cli.main(["serve", "--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9/"]) == 1
    assert capsys.readouterr().err.strip() == ("tokendance serve: --engine http://127.0.0.1:9 is given twice: "
                                               "name each server once")
    assert cli.main(["serve", "--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:10"]) == 1
    assert "no engine at http://127.0.0.1:9" in capsys.readouterr().err


# -- two real engines ------------------------------------------------------------------------


@pytest.fixture
async def pair(tiny_llama) -> Any:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(served(tiny_llama, offload_bytes=0)) for _ in range(2)]
        yield [(e.url, e.backend, e.runner) for e in engines]


async def test_two_engines_serve_two_sessions_each_round_on_its_engine(pair, start):
    fleet = await Fleet.connect([u for u, _, _ in pair], lambda u: RemoteBackend.connect(u, "collective"))
    server = await start(fleet, barrier_timeout=10.0)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    name = fleet.info.name
    block = " ".join(f"fact{i}" for i in range(40))

    async def turn(session: str, agent: str, rnd: int) -> Any:
        return await c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"I am {agent}.{SEP}{block}{SEP}Answer."}],
            max_tokens=3, temperature=0,
            extra_body={"tokendance": {"session": session, "agent": agent, "round": rnd, "separators": True}})

    async with httpx.AsyncClient(base_url=server.url) as http:
        for rnd in (1, 2):
            for s in ("red", "blue"):
                await http.post(f"/v1/tokendance/sessions/{s}/rounds/{rnd}", json={"agents": ["a", "b", "c"]})
            rs = await asyncio.gather(*[turn(s, a, rnd) for s in ("red", "blue") for a in "abc"])
            for s in ("red", "blue"):
                stats = (await http.get(f"/v1/tokendance/sessions/{s}/rounds/{rnd}")).json()
                assert (stats["groups"], stats["requests"]) == (1, 3) and stats["reused_tokens"] > 0
        # The same prompts on two engines of the same model: the same answers.
        texts = [r.choices[0].message.content for r in rs]
        assert texts[:3] == texts[3:]
        assert sorted(p.engine for p in fleet.pins.values()) == [0, 1]  # one session on each engine
        assert all(be.engine.segments.held > 0 for _, be, _ in pair)  # each keeps its round's Masters
        metrics = (await http.get("/metrics")).text
        for url, _, _ in pair:
            assert f'tokendance_engine_fleet_sessions{{engine="{url}"}} 1' in metrics


@pytest.mark.parametrize("n", [2, 3])
async def test_a_beam_search_through_a_fleet_stays_on_one_engine(pair, start, n):
    """Its steps, outside any session, share a route: they stay on one engine, whose
    prefix cache holds the beams' past (taking the engines in turn, each step found only
    what the step before the last had left there); the same beams as on one engine."""
    fleet = await Fleet.connect([u for u, _, _ in pair], lambda u: RemoteBackend.connect(u, "collective"))
    one = await RemoteBackend.connect(pair[0][0], "collective")
    assert fleet.info.eos == one.info.eos != ()
    kw = dict(model=fleet.info.name, prompt="The market opens", max_tokens=4, n=n,
              extra_body={"use_beam_search": True, "return_token_ids": True})
    added: list[list[str]] = [[], []]
    for i, (_, be, _) in enumerate(pair):
        def counted(req, *a, i=i, add=be.engine.add, **kw):
            added[i].append(req)
            return add(req, *a, **kw)
        be.engine.add = counted
    got = []
    for be in (fleet, one):
        server = await start(be)
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        res = await c.completions.create(**kw)
        got.append([c.model_extra["token_ids"] for c in res.choices])
        if be is fleet:
            on = [len(a) for a in added]
            assert sorted(on) == [0, 1 + n * 3], (n, added)  # one beam's step, then n beams x 3 steps
    assert got[0] == got[1] and len({tuple(t) for t in got[0]}) == n
    assert len(fleet.routes) == 1


async def test_a_lost_engine_moves_its_session_and_the_proxy_keeps_serving(pair, start):
    fleet = await Fleet.connect([u for u, _, _ in pair], lambda u: RemoteBackend.connect(u, "collective"))
    server = await start(fleet)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
    kw = dict(model=fleet.info.name, messages=[{"role": "user", "content": "Tell me about rivers."}],
              max_tokens=4, temperature=0)
    first = await c.chat.completions.create(**kw, extra_body={"tokendance": {"session": "s", "agent": "a"}})
    (pin,) = fleet.pins.values()  # the one session's
    i = pin.engine
    await pair[i][2].cleanup()  # that engine's socket closes
    # The next request may still be sent there (the poll has not seen it yet): the fleet
    # sends it again to the other engine (test_failover.py), with no retry by the client.
    again = await c.chat.completions.create(**kw, extra_body={"tokendance": {"session": "s", "agent": "a"}})
    assert pin.engine == 1 - i
    assert again.choices[0].message.content == first.choices[0].message.content
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).status_code == 200  # one engine serves
        await pair[1 - i][2].cleanup()
        for _ in range(100):  # the proxy polls each engine every 2 s
            health = await http.get("/health")
            if health.status_code == 503:
                break
            await asyncio.sleep(0.05)
    assert health.json()["error"]["message"].startswith("no engine can serve: ")


def test_a_group_one_engine_fails_stops_on_every_engine(make_backend):
    class Broken:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def generate(self, group: list[Prepared]) -> list[Any]:
            raise BackendError("lost")

    ok = make_backend()
    f = Fleet([Broken(make_backend()), ok])
    f.pins.update({("", "s"): Pin(0, 0.0), ("", "t"): Pin(1, 0.0)})
    with pytest.raises(BackendError, match="lost"):  # the group fails whole
        f.generate([f.prepare(request("b", "t")), f.prepare(request("a", "s"))])
    assert ok.aborted == {"b"} and not ok.active  # what the other engine started stopped


async def test_a_group_the_engine_lost_marks_it_down_at_once(pair):
    url, _, runner = pair[0]
    r = await RemoteBackend.connect(url)
    await runner.cleanup()
    (st,) = r.generate([r.prepare(request("a"))])
    with pytest.raises(Unavailable, match="cannot reach the engine"):
        [d async for d in st]
    assert r.problem() is not None  # before any poll could have seen it
    await r.close()


def test_a_pin_another_proxy_decided_first_wins(three):
    f, engines, _ = three
    f.names = ["e0", "e1", "e2"]
    told = []
    f.origin, f.on_pin = "me", lambda *pin: told.append(pin)
    assert f.route(request("a", "s")) == 0 and told[-1][:2] == (("", "s"), "e0")
    mine = told[-1][2]
    f.adopt(("", "s"), "e1", (mine[0] + 1, "peer"))  # decided after mine: mine stays
    assert f.route(request("b", "s")) == 0
    f.adopt(("", "s"), "e1", (mine[0] - 1, "peer"))  # decided before mine: everyone goes there
    assert f.route(request("c", "s")) == 1
    f.adopt(("", "s"), "e9", (0.0, "peer"))  # not one of these engines
    engines[2].down = "gone"
    f.adopt(("", "s"), "e2", (0.0, "peer"))  # cannot serve
    assert f.route(request("d", "s")) == 1
    f.adopt(("", "new"), "e2", (5.0, "peer"))  # a session not pinned here yet takes the peer's pin
    engines[2].down = None
    assert f.route(request("e", "new")) == 2 and len(told) == 1  # adopting tells nobody
