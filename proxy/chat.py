"""A chat call from its checks to its streams: what chat completions, the Responses API
and the Messages API share once their requests are a chat, and vLLM's batch of chats
(`/v1/chat/completions/batch`: one call whose conversations are its prompts, one choice
each, prefilled in one group, so a round's agents can come in one request)."""

from __future__ import annotations

from functools import partial
from typing import Any

from msgspec.structs import replace

from tokendance.backend.api import SamplingParams, Template
from tokendance.backend.protocol import Stream

from . import echo, functions, schemas, segment
from .call import Call
from .core import Proxy
from .errors import ApiError, invalid, unsupported
from .reasoning import budget, held_after
from .schemas import ChatRequest, Message


class BatchChatRequest(ChatRequest, kw_only=True):
    messages: list[list[Message]]  # the conversations


async def start(px: Proxy, call: Call, body: ChatRequest, batch: list[list[Message]] | None = None) -> list[Stream]:
    """A chat call from its checks to its streams, once its group has started."""
    prepare(px, call, body, batch)
    return await px.admit(call)


def prepare(px: Proxy, call: Call, body: ChatRequest, batch: list[list[Message]] | None = None) -> None:
    """A chat call checked, segmented and prepared: what comes before its barrier. With
    `batch`, each conversation is a prompt of the call."""
    convs = [body.messages] if batch is None else batch
    call.check_agents(len(convs))
    template = schemas.template(body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message,
                                body.reasoning_effort, schemas.own(body.chat_template, px.config.trust_chat_template))
    checked = [_checked(px, call, body if batch is None else replace(body, messages=m), k, batch is not None,
                        template) for k, m in enumerate(convs)]
    call.meta.resumes = checked[0][0][-1]["role"] == "tool"
    # vLLM's: the server's response role where the prompt asks for an answer, else the role
    # the prompt ends in (the one continue_final_message goes on with)
    call.role = px.config.response_role if body.add_generation_prompt else checked[0][0][-1]["role"]
    call.hide_reasoning = not body.include_reasoning and px.config.reasoning is not None
    call.show_prompt = body.return_prompt_text and batch is None  # a batch's prompts are its choices'
    if body.echo and any(m[-1]["role"] == "assistant" for m, _ in checked):  # what continue_final_message goes on from
        call.echo = echo.make([m[-1]["content"] if m[-1]["role"] == "assistant" else "" for m, _ in checked],
                              body.n, False, 0, None)
    known = px.place(call)
    think = budget(px.config.reasoning, px.backend, body.thinking_token_budget)  # once for every prompt
    for messages, sampling in checked:
        messages, render = px.chat_form(messages, call.tools, template)
        prompt = segment.chat(render, messages, call.meta.separators, known)
        if px.config.reasoning is not None and sampling.structure is not None:  # the model thinks first
            sampling.structure = held_after(sampling.structure, "".join(s.text for s in prompt))
        sampling.think_budget = think
        px.prepare(call, [prompt], sampling, body.add_special_tokens)


def _checked(px: Proxy, call: Call, body: ChatRequest, k: int, batch: bool,
             template: Template | None) -> tuple[list[dict[str, Any]], SamplingParams]:
    try:
        call.legacy = functions.legacy(body)
        messages, sampling, call.tools = schemas.check_chat(functions.as_tools(body), partial(px.dialect, template),
                                                            px.backend.info)
    except ApiError as exc:  # named in the batch: messages[k][i]...
        if batch and exc.body.param and exc.body.param.startswith("messages"):
            exc.body.param = f"messages[{k}]" + exc.body.param.removeprefix("messages")
        raise
    return messages, sampling


def check_batch(body: BatchChatRequest) -> None:
    """What vLLM's batch of chats does not take."""
    if not body.messages or not all(body.messages):
        raise invalid("messages must hold at least one conversation, each of at least one message", "messages")
    if body.stream:
        raise unsupported("stream", "streaming a batch of chats")
    if body.tools or body.functions:
        raise unsupported("tools" if body.tools else "functions", "tools in a batch of chats")
    if body.n != 1:
        raise unsupported("n", "n other than 1 in a batch of chats")
    if body.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "prompt_logprobs in a batch of chats")
