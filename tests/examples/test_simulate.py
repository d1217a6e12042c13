"""`tokendance simulate` end to end through the proxy, on the echo backend."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tokendance.adapters.rounds import ProxyError, Rounds
from tokendance.backend.api import Unavailable
from tokendance.backend.ngram import Speculation
from tokendance.examples import cli
from tokendance.examples.client import Client
from tokendance.examples.debate import Debate
from tokendance.examples.echo import EchoBackend
from tokendance.examples.local import proxy, threaded
from tokendance.examples.client import Reply
from tokendance.examples.loop import Round, run
from tokendance.examples.table import diverged, row
from tests.proxy.test_unavailable import Restarting

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tokendance.proxy.app") is None,
                                reason="tokendance.proxy.app is not in this tree yet")


def _lines(out: str) -> list[list[str]]:
    """The rows of the per-round tables (lines that start with a round number)."""
    return [line.split() for line in out.splitlines() if line.endswith(" ms")]


@pytest.mark.parametrize("name", ["debate", "town", "society"])
def test_simulate_prints_rounds(name: str, capsys) -> None:
    assert cli.main(["simulate", name, "--model", "echo", "--agents", "4", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{name}: 4 agents, mode collective, seed 0" in out
    rows = _lines(out)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(r[1] == "4" and r[2] == "1" for r in rows)  # 4 agents, one group a round
    assert float(rows[-1][5]) > 0  # reused %


def test_compare_runs_full_and_mode(capsys) -> None:
    argv = ["simulate", "debate", "--model", "echo", "--agents", "3", "--rounds", "2", "--compare"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "mode full" in out and "mode collective" in out
    rows = _lines(out)
    assert len(rows) == 4 and rows[1][5] == "0.0" and float(rows[3][5]) > 0
    assert "outputs identical in all 2 rounds" in out  # echo replies ignore the mode


def test_url_uses_a_running_proxy(capsys) -> None:
    with threaded(EchoBackend("prefix")) as url:
        assert cli.main(["simulate", "town", "--url", url, "--agents", "2", "--rounds", "1"]) == 0
    assert "town: 2 agents, mode server default" in capsys.readouterr().out


def test_user_mistakes_are_one_line(capsys) -> None:
    assert cli.main(["simulate", "debate", "--model", "echo", "--agents", "0"]) == 1
    assert capsys.readouterr().err.strip().endswith("must be at least 1")
    assert cli.main(["simulate", "debate", "--url", "http://127.0.0.1:9"]) == 1
    assert "no proxy answers at http://127.0.0.1:9" in capsys.readouterr().err
    assert cli.main(["simulate", "debate", "--model", "echo", "--rounds", "1", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("proxy answered 400: temperature must be between 0 and 2") and "\n" not in err


@pytest.mark.parametrize("retries, ok", [(2, False), (3, True)])
def test_retries_ride_out_an_engine_restart(capsys, retries, ok) -> None:
    with threaded(Restarting(Unavailable("cannot reach the engine", 0.01), down=3)) as url:  # Retry-After: 1
        rc = cli.main(["simulate", "debate", "--url", url, "--agents", "2", "--rounds", "1",
                       "--retries", str(retries)])
    out, err = capsys.readouterr()
    # each agent's each try but the last is named in the log (two agents, three refusals)
    assert err.count("sending again") == 2 * min(3, retries) and f"1 of {retries}" in err
    if ok:
        assert rc == 0 and len(_lines(out)) == 1
    else:
        # the CLI's own last line (the proxy, in this process, may log after it)
        assert rc == 1 and any(line.endswith("proxy answered 503: engine unavailable: cannot reach the engine")
                               for line in err.splitlines())
    assert cli.main(["simulate", "debate", "--model", "echo", "--retries", "-1"]) == 1
    assert capsys.readouterr().err.strip().endswith("--retries must be at least 0")


async def test_loop_and_divergence() -> None:
    async with proxy(EchoBackend()) as url:
        async with Client(url, "loop-1", model="echo", seed=1) as c:
            a = await run(Debate(3, 0), c, 2)
        async with Client(url, "loop-2", model="echo", seed=2) as c:
            b = await run(Debate(3, 0), c, 2)
        async with Client(url, "loop-3", model="nope") as c:
            with pytest.raises(ProxyError, match="404"):
                await c.chat("Ada", 1, [{"role": "user", "content": "hi"}])
        assert (await Rounds("loop-1", url).astats(2))["groups"] == 1
    assert a[1].stats["reused_tokens"] > 0
    assert diverged(a, a) == "outputs identical in all 2 rounds"
    assert diverged(a, b).startswith("outputs first diverged in round 1, agent Ada, word ")


def test_module_entry_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokendance.examples.society", "--model", "echo", "--agents", "3", "--rounds", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "society: 3 agents" in out.stdout and "know about the bridge" in out.stdout


@pytest.fixture()
def made(monkeypatch) -> list:
    """The engine backends simulate loads, as it loads them."""
    from tokendance.backend.service import EngineBackend

    out = []
    load = EngineBackend.load.__func__
    monkeypatch.setattr(EngineBackend, "load",
                        classmethod(lambda cls, *a, **kw: out.append(load(cls, *a, **kw)) or out[-1]))
    return out


def test_reuse_flags_reach_the_in_process_engine(tiny_llama, made, capsys) -> None:
    argv = ["simulate", "debate", "--model", str(tiny_llama), "--agents", "3", "--rounds", "2",
            "--max-tokens", "4", "--bases", "reader", "--recompute-ratio", "0.3", "--kv-cache-dtype", "fp8",
            "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    assert cli.main(argv) == 0
    cfg = made[0].engine.collector.cfg
    assert cfg.readers and cfg.ratio == 0.3 and cfg.floor == 0.0
    assert made[0].engine.cache.kv.dtype == torch.float8_e4m3fn
    assert made[0].engine.speculator.spec == Speculation(3, 2, 2)
    assert "debate: 3 agents, mode collective" in capsys.readouterr().out


def test_a_tensor_parallel_engine_runs_the_debate_and_stops_with_it(tiny_llama, made, capsys) -> None:
    argv = ["simulate", "debate", "--model", str(tiny_llama), "--agents", "2", "--rounds", "2",
            "--max-tokens", "4", "-tp", "2"]
    assert cli.main(argv) == 0
    assert "debate: 2 agents, mode collective" in capsys.readouterr().out
    tp = made[0].engine.tp
    assert tp.size == 2 and tp.agreed  # closed with the proxy, its follower's tokens the same
    assert not any(p.is_alive() for p in tp.procs)


def test_the_town_recalls_by_the_engines_embeddings_and_judgement(tiny_llama, capsys) -> None:
    argv = ["simulate", "town", "--model", str(tiny_llama), "--agents", "3", "--rounds", "3", "--max-tokens", "4"]
    assert cli.main(argv) == 0
    assert "3 townsfolk, 18 memories, recalled by relevance, importance and recency" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--bases", "reader"], ["-tp", "2"], ["--kv-cache-dtype", "fp8"],
                                  ["--speculative-config", '{"num_speculative_tokens": 2}']])
def test_engine_flags_need_the_in_process_engine(capsys, flag) -> None:
    assert cli.main(["simulate", "debate", "--url", "http://127.0.0.1:9", *flag]) == 1
    err = capsys.readouterr().err.strip()
    assert "--speculative-config set the in-process engine" in err and "\n" not in err


def test_the_rounds_held_kv_counts_the_shared_blocks_once() -> None:
    usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4},
             "tokendance": {"kv_held_bytes": 1024, "kv_dense_bytes": 4096}}
    replies = {a: Reply(a, "x", usage, 0.1) for a in "ab"}
    stats = {"kv_held_bytes": 2048, "kv_shared_bytes": 1024, "kv_dense_bytes": 8192, "prompt_tokens": 20,
             "reused_tokens": 8}
    assert row(Round(1, replies, 0.5, stats))["KV held/dense"] == "3.0 KiB / 8.0 KiB (38%)"
    # Without the proxy's round stats: the replies' own usage (no shared blocks known).
    alone = row(Round(1, replies, 0.5))
    assert alone["KV held/dense"] == "2.0 KiB / 8.0 KiB (25%)" and alone["reused %"] == "40.0"


async def test_the_responses_api_runs_the_same_simulation(tiny_llama) -> None:
    """Through /v1/responses each agent continues its stored conversation, or its
    conversation object, sending only its new message; through /v1/messages it sends
    Anthropic's messages; a batch of chats sends a round in one request: same prompts, so
    the same greedy answers and the same reuse."""
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="collective")
    apis = ("chat", "responses", "conversations", "messages", "batch")
    async with proxy(be) as url:
        runs, chains = {}, {}
        for api in apis:
            async with Client(url, f"api-{api}", model=be.info.name, max_tokens=6, api=api,
                              api_key=f"key-{api}") as c:  # no KV reused across the runs
                runs[api] = await run(Debate(3, 0), c, 3)
                chains[api] = dict(c.chains)
    for api in apis[1:]:
        assert diverged(runs["chat"], runs[api]) == "outputs identical in all 3 rounds"
        for a, b in zip(runs["chat"], runs[api]):
            assert a.stats["reused_tokens"] == b.stats["reused_tokens"] and a.stats["groups"] == b.stats["groups"] == 1
        assert runs[api][-1].stats["reused_tokens"] > 0
        if api not in ("messages", "batch"):  # each agent's stored conversation holds its whole debate
            assert all(len(conversation) == 6 for _, conversation in chains[api].values())
    assert all(kept.startswith("conv_") for kept, _ in chains["conversations"].values())


@pytest.mark.parametrize("api", ["responses", "conversations", "messages", "batch"])
def test_simulate_takes_the_responses_and_messages_apis(capsys, api) -> None:
    assert cli.main(["simulate", "town", "--model", "echo", "--agents", "3", "--rounds", "2", "--api", api]) == 0
    rows = _lines(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["1", "2"] and float(rows[-1][5]) > 0


@pytest.mark.parametrize("api", ["chat", "batch"])
def test_repetition_detection_ends_looping_replies(tiny_llama, capsys, api) -> None:
    """The tiny random model loops: replies end at a pattern of 1-4 tokens seen twice,
    and the next round's prompts, which quote them, are shorter."""
    def run(*extra: str) -> str:
        argv = ["simulate", "debate", "--model", str(tiny_llama), "--agents", "2", "--rounds", "3",
                "--max-tokens", "32", "--api", api, *extra]
        assert cli.main(argv) == 0
        return capsys.readouterr().out

    plain, cut = run(), run("--repetition-detection", "4,2")
    assert "repetition detection" not in plain
    ended = int(cut.split("replies ended by repetition detection: ")[1].split(" of 6")[0])
    assert ended > 0
    assert int(_lines(cut)[2][3]) < int(_lines(plain)[2][3])  # round 3's prompt tokens


@pytest.mark.parametrize("argv, message", [
    (["--repetition-detection", "4,1"], "COUNT at least 2"),
    (["--repetition-detection", "0"], "SIZE at least 1"),
    (["--repetition-detection", "4,3,2"], "expected SIZE[,COUNT]"),
    (["--repetition-detection", "x"], "expected SIZE[,COUNT]"),
    (["--repetition-detection", "8", "--api", "responses"], "use --api chat or batch"),
])
def test_repetition_detection_mistakes_are_one_line(capsys, argv, message) -> None:
    try:
        code = cli.main(["simulate", "debate", "--model", "echo", "--rounds", "1", *argv])
    except SystemExit as e:  # argparse's: its usage line, then the error
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code in (1, 2) and message in err
