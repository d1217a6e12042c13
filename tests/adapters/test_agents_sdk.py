"""The OpenAI Agents SDK through the proxy, by the Responses API (its default model) and by
chat completions: a function tool's loop, a streamed run, a second round that quotes the
first's answers, a stored response continued and a conversation object. The SDK runs in a venv of its own
(.venv-agents, made by .ci/setup; see tests/adapters/agents_sdk_run.py); the proxy here,
in front of a backend that echoes the prompt's last message, so a call in the prompt comes
back as the model's call."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from tokendance.adapters.rounds import Rounds
from tokendance.examples.local import threaded

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-agents" / "bin" / "python"
pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason="no .venv-agents (bash .ci/setup makes it)")


def _fake():
    spec = importlib.util.spec_from_file_location("proxy_fake_backend", ROOT / "tests/proxy/fake_backend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakeBackend


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_two_agents_a_tool_and_two_rounds(api):
    with threaded(_fake()(length=40), barrier_timeout=10.0) as url:
        ctl = Rounds(f"agents-{api}", url)
        ctl.announce(1, ["ada", "bo"])
        run = subprocess.run([str(PYTHON), str(Path(__file__).with_name("agents_sdk_run.py")), url, "fake-tiny", api],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.splitlines()[-1])
        one, two = ctl.stats(1), ctl.stats(2)
    # The call the model wrote, run by the SDK, its result read back in ada's next request
    assert out["calls"] == [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]
    assert out["outputs"] == ["18 C and sunny in Oslo"] and "18 C and sunny in Oslo" in out["said"]["ada"]
    # bo's run streamed the API's events, one text delta per word
    assert out["said"]["bo"] == "Say hello to everyone in the room today."
    kinds = out["kinds"]
    assert kinds.count("response.output_text.delta") == 8 and "response.completed" in kinds
    # Round 1: both agents in one group; the tool's result resumed ada's turn, not a new round
    assert (one["agents"], one["group_sizes"], one["requests"], one["errors"]) == (["ada", "bo"], [2], 3, 0)
    # Round 2: one group again, and each prompt quoted the other's answer as a shared segment
    assert (two["group_sizes"], two["requests"], two["errors"]) == ([2], 2, 0) and two["shared_tokens"] > 0
    assert out["second"] == ["bo said: Say hello to everyone in the room today. What do you say?",
                             f"ada said: {out['said']['ada']} What do you say?"]
    ada, bo = two["per_agent"]["ada"]["prompt_tokens"], two["per_agent"]["bo"]["prompt_tokens"]
    if api == "responses":  # ada's stored conversation (the tool loop) came before her new input,
        assert ada > bo + 30, (ada, bo)  # and bo's conversation object got his turn
        asked = f"ada said: {out['said']['ada']}\nWhat do you say?"
        assert out["conversation"] == ["Hello, bo.", asked, asked.replace("\n", " ")], out["conversation"]
    else:
        assert abs(ada - bo) < 10, (ada, bo)
