"""LangGraph: a 3-agent, 2-round All-Gather built with Send fan-out and a gather node."""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

import openai
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.types import Send  # noqa: E402

from tokendance.adapters.langgraph import chat_model, tag  # noqa: E402
from tokendance.adapters.rounds import Rounds, served_model  # noqa: E402
from tokendance.adapters.tags import PREFIX, api_base  # noqa: E402

from .conftest import AGENTS  # noqa: E402

QUESTION = "How many legs do three spiders have in total?"
ROUNDS = 2


class State(TypedDict):
    round: int
    answers: Annotated[list[tuple[int, str, str]], operator.add]  # (round, agent, text)


class Turn(TypedDict):
    round: int
    agent: str
    others: str


def build(url: str, session: str, **kw):
    llm = chat_model(session, url=url, max_tokens=16, temperature=0.0, max_retries=0, **kw)
    ctl = Rounds(session, url)

    def start(state: State) -> dict:
        ctl.announce(state["round"], AGENTS)
        return {}

    def fan_out(state: State) -> list[Send]:
        r = state["round"]
        prev = {a: t for k, a, t in state["answers"] if k == r - 1}
        view = lambda a: "\n\n".join(f"{b} answered:\n{prev[b]}" for b in AGENTS if b != a)  # noqa: E731
        return [Send("speak", Turn(round=r, agent=a, others=view(a) if prev else "")) for a in AGENTS]

    def speak(turn: Turn) -> dict:
        msgs = [("system", f"You are {turn['agent']}."), ("user", QUESTION)]
        if turn["others"]:
            msgs.append(("user", f"Others answered:\n\n{turn['others']}\n\nRevise your answer."))
        out = llm.invoke(msgs, **tag(turn["agent"], turn["round"]))
        return {"answers": [(turn["round"], turn["agent"], out.text)]}  # the Responses API gives content blocks

    def gather(state: State) -> dict:
        return {"round": state["round"] + 1}

    g = StateGraph(State)
    g.add_node("start", start)
    g.add_node("speak", speak)
    g.add_node("gather", gather)
    g.add_edge(START, "start")
    g.add_conditional_edges("start", fan_out, ["speak"])
    g.add_edge("speak", "gather")
    g.add_conditional_edges("gather", lambda s: "start" if s["round"] <= ROUNDS else END)
    return g.compile()


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_all_gather(proxy_url: str, check_rounds, responses: bool) -> None:
    """Also through OpenAI's Responses API (`use_responses_api`), LangChain's other client."""
    session = f"lg-1-{responses}"
    # One call first, alone: the openai SDK defers building its pydantic models to their
    # first use, which pydantic up to 2.12 (camel-ai's pin) does not make thread-safe, so
    # the graph's concurrent first calls could fail inside the SDK (pydantic PR #13438).
    sdk = openai.OpenAI(base_url=api_base(proxy_url), api_key="none", max_retries=0)
    ask = dict(model=served_model(proxy_url), max_output_tokens=1, input="hi") if responses else \
        dict(model=served_model(proxy_url), max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    (sdk.responses if responses else sdk.chat.completions).create(**ask)  # no session: no barrier
    out = build(proxy_url, session, use_responses_api=responses).invoke({"round": 1, "answers": []})
    assert sorted((r, a) for r, a, _ in out["answers"]) == [(r, a) for r in (1, 2) for a in AGENTS]
    assert all(isinstance(t, str) and t for _, _, t in out["answers"])
    check_rounds(session, ROUNDS)


def test_all_gather_of_claude_agents(proxy_url: str, check_rounds) -> None:
    """The same graph with ChatAnthropic: Anthropic's Messages API, tagged alike."""
    pytest.importorskip("langchain_anthropic")
    out = build(proxy_url, "lg-claude", anthropic=True).invoke({"round": 1, "answers": []})
    assert sorted((r, a) for r, a, _ in out["answers"]) == [(r, a) for r in (1, 2) for a in AGENTS]
    assert all(isinstance(t, str) and t for _, _, t in out["answers"])
    check_rounds("lg-claude", ROUNDS)


def test_tags(proxy_url: str) -> None:
    llm = chat_model("lg-2", url=proxy_url, agent="Ada", mode="collective")
    assert llm.model_name == "echo"
    assert llm.default_headers == {PREFIX + "Session": "lg-2", PREFIX + "Agent": "Ada",
                                   PREFIX + "Mode": "collective"}
    assert tag("Bo", 3) == {"extra_headers": {PREFIX + "Agent": "Bo", PREFIX + "Round": "3"}}
