"""A chat call from its checks to its streams: what chat completions, the Responses API
and the Messages API share once their requests are a chat."""

from __future__ import annotations

from tokendance.backend.api import Stream

from . import echo, schemas, segment
from .call import Call
from .core import Proxy
from .reasoning import held_after


async def start(px: Proxy, call: Call, body: schemas.ChatRequest) -> list[Stream]:
    """A chat call from its checks to its streams, once its group has started."""
    prepare(px, call, body)
    return await px.admit(call)


def prepare(px: Proxy, call: Call, body: schemas.ChatRequest) -> None:
    """A chat call checked, segmented and prepared: what comes before its barrier."""
    messages, sampling, call.tools = schemas.check_chat(body, px.dialect, px.backend.info)
    template = schemas.template(body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message)
    call.meta.resumes = messages[-1]["role"] == "tool"
    if body.echo and messages[-1]["role"] == "assistant":  # what continue_final_message goes on from
        call.echo = echo.make([messages[-1]["content"]], body.n, False, 0, None)
    known = px.place(call)
    messages, render = px.chat_form(messages, call.tools, template)
    prompt = segment.chat(render, messages, call.meta.separators, known)
    if px.config.reasoning is not None and sampling.structure is not None:  # the model thinks first
        sampling.structure = held_after(sampling.structure, "".join(s.text for s in prompt))
    px.prepare(call, [prompt], sampling, body.add_special_tokens)
