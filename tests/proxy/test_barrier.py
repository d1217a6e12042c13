import asyncio
import time

from tokendance.proxy.barrier import Barrier, Entry, Gate


def make(timeout: float = 10.0, max_size: int = 256) -> tuple[Barrier, list]:
    groups: list[tuple[str, list]] = []

    def dispatch(gate, entries, reason):
        groups.append((reason, [e.agent for e in entries]))
        for e in entries:
            e.future.set_result([])

    return Barrier(dispatch, timeout, max_size), groups


def arrive(b: Barrier, gate: Gate, agent: str | None) -> asyncio.Task:
    e = Entry(agent, [], asyncio.get_running_loop().create_future())
    return asyncio.create_task(b.wait(gate, e))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_holds_until_every_expected_agent_arrived():
    b, groups = make()
    g = Gate()
    b.expect(g, ["a", "b", "c"])
    first = [arrive(b, g, x) for x in "ab"]
    await asyncio.sleep(0.02)
    assert groups == [] and b.waiting == 2
    await arrive(b, g, "c")
    await asyncio.gather(*first)
    assert groups == [("all", ["a", "b", "c"])] and b.waiting == 0


async def test_timeout_counts_from_the_first_arrival():
    b, groups = make(timeout=0.05)
    g = Gate()
    b.expect(g, ["a", "b"])
    t0 = time.perf_counter()
    task = arrive(b, g, "a")
    await asyncio.sleep(0.03)
    arrive(b, g, "x")  # a later arrival does not restart the clock
    await task
    assert 0.045 <= time.perf_counter() - t0 < 1.0
    await settle()
    assert groups == [("timeout", ["a", "x"])]


async def test_seal_releases_the_group_and_lets_later_arrivals_through():
    b, groups = make()
    g = Gate()
    tasks = [arrive(b, g, x) for x in "ab"]
    await settle()
    b.seal(g)
    await asyncio.gather(*tasks)
    await arrive(b, g, "c")
    assert groups == [("sealed", ["a", "b"]), ("sealed", ["c"])]


async def test_a_full_group_goes_at_max_size():
    b, groups = make(max_size=3)
    g = Gate()
    tasks = [arrive(b, g, f"a{i}") for i in range(7)]
    await settle()
    assert [len(x[1]) for x in groups] == [3, 3] and {x[0] for x in groups} == {"full"}
    b.seal(g)
    await asyncio.gather(*tasks)
    assert groups[-1] == ("sealed", ["a6"])


async def test_straggler_goes_as_soon_as_the_last_missing_agent_arrives():
    b, groups = make(timeout=0.03)
    g = Gate()
    b.expect(g, ["a", "b", "c"])
    await asyncio.gather(arrive(b, g, "a"), arrive(b, g, "b"))
    late = arrive(b, g, "x")  # not expected: waits for c
    await asyncio.sleep(0.01)
    assert not late.done()
    await arrive(b, g, "c")
    await late
    assert groups == [("timeout", ["a", "b"]), ("all", ["x", "c"])]


async def test_a_waiter_that_leaves_is_missing_again():
    b, groups = make()
    g = Gate()
    b.expect(g, ["a", "b"])
    gone = arrive(b, g, "a")
    await settle()
    gone.cancel()
    await settle()
    other = arrive(b, g, "b")
    await asyncio.sleep(0.01)
    assert groups == [] and not other.done() and b.waiting == 1
    await arrive(b, g, "a")
    await other
    assert groups == [("all", ["b", "a"])]


async def test_announcing_after_the_arrivals_releases_them():
    b, groups = make()
    g = Gate()
    tasks = [arrive(b, g, x) for x in "ab"]
    await settle()
    assert groups == []
    b.expect(g, ["b", "a"])
    await asyncio.gather(*tasks)
    assert groups == [("all", ["a", "b"])]


async def test_zero_timeout_never_holds():
    b, groups = make(timeout=0.0)
    g = Gate()
    await arrive(b, g, "a")
    await arrive(b, g, None)
    assert [r for r, _ in groups] == ["timeout", "timeout"]


async def test_an_agent_whose_request_went_unanswered_is_awaited_again():
    b, groups = make()
    g = Gate()
    b.expect(g, ["a", "b", "c"])
    await asyncio.gather(*[arrive(b, g, x) for x in "abc"])
    for x in "ab":  # their engine could not take them: they will be sent again
        b.unanswered(g, x)
    b.unanswered(g, "z")  # not one of the round's agents
    assert g.missing == {"a", "b"} and g.done == {"c"}
    first = arrive(b, g, "a")
    await asyncio.sleep(0.02)
    assert len(groups) == 1  # a waits for b's retry
    await asyncio.gather(first, arrive(b, g, "b"))
    assert groups[1] == ("all", ["a", "b"])
