"""Routes. Each completion handler reads top to bottom as a request's life:
parse -> segment -> prepare (before the barrier) -> barrier -> generate -> stream.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import weakref

import msgspec
import structlog
from aiohttp import web

from . import chat, conversations, cors, echo, embeddings as vectors, generative, messages, reasoning, replies
from . import responses, schemas, scores, segment
from . import tokenize as tokens
from .answer import Turn, follow, starting_after
from .core import Proxy
from .errors import ApiError, invalid, keys, middleware
from .mqtt import Control
from .respond import reply
from .route import PROXY, T0, json_answer, tracked
from .session import round_number

log = structlog.get_logger("tokendance.proxy")
try:
    VERSION = importlib.metadata.version("tokendance")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
    VERSION = "0+source"
CONTROL = web.AppKey("control", object)


@tracked("chat")
async def chat_completions(req: web.Request) -> web.StreamResponse:
    px = req.app[PROXY]
    body = schemas.decode(await req.read(), schemas.ChatRequest)
    call = px.call("chat", body, req.headers, req[T0])
    streams = await chat.start(px, call, body)
    return await reply(req, px, call, streams)


@tracked("chat_batch")
async def chat_batch(req: web.Request) -> web.StreamResponse:
    """vLLM's batch of chats: one call, a prompt and a choice per conversation."""
    px = req.app[PROXY]
    body = schemas.decode(await req.read(), chat.BatchChatRequest)
    chat.check_batch(body)
    call = px.call("chat", body, req.headers, req[T0])
    call.batch = True
    return await reply(req, px, call, await chat.start(px, call, body, body.messages))


@tracked("responses")
async def create_response(req: web.Request) -> web.StreamResponse:
    """The Responses API: a chat call underneath (proxy/responses.py, proxy/answer.py)."""
    px = req.app[PROXY]
    body = schemas.decode(await req.read(), responses.ResponsesRequest)
    responses.check(body)
    owner = px.tenant(req.headers)
    prev, conv = None, None
    if body.previous_response_id is not None:
        prev = px.stored.get(body.previous_response_id, owner)
        if prev is None:
            raise invalid(f"Previous response with id {body.previous_response_id!r} not found.",
                          "previous_response_id", "previous_response_not_found")
    if (cid := responses.conversation_id(body)) is not None:
        conv = conversations.find(px, cid, owner, "conversation")
    history = prev.history if prev else conv.history() if conv else []
    turn = Turn(body, responses.messages(body.input), history, owner, conversation=conv)
    if body.store or conv:
        turn.inputs = msgspec.json.encode(responses.listed(body.input))
    asked = responses.chat(body, turn.history, turn.new, body.tokendance)
    call = px.call("response", asked, req.headers, req[T0])
    tags = prev.tags if prev else conv.tags if conv else None
    if tags is not None and call.meta.session is None:  # a conversation stays in its session
        call.meta.session, call.meta.agent, mode = tags
        call.meta.mode = call.meta.mode or mode
    drop = 0  # with truncation auto, the conversation's oldest turns left out until it fits
    while True:
        try:
            chat.prepare(px, call, responses.chat(body, turn.history[drop:], turn.new, body.tokendance))
            break
        except ApiError as exc:
            if body.truncation != "auto" or exc.body.code != "context_length_exceeded" or drop == len(turn.history):
                raise responses.renamed(exc) if exc.status == 400 else exc
            drop = responses.next_turn(turn.history, drop)
    if body.background:  # answered at once; the response is read back (or followed) as it goes
        r = turn.background(px, call)
        return await follow(req, turn.feed, -1, call.headers()) if turn.feed else json_answer(r)
    return await reply(req, px, call, await px.admit(call), turn.write)


async def get_response(req: web.Request) -> web.StreamResponse:
    """A stored response; with `stream=true`, a streamed background response's events
    (from after `starting_after`), as they come."""
    px = req.app[PROXY]
    s = px.stored.get(req.match_info["id"], px.tenant(req.headers))
    if s is None:
        raise _no_response(req)
    stream = req.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise invalid("stream must be true or false", "stream")
    if stream == "false":
        return web.Response(body=s.body, content_type="application/json")
    after = starting_after(req.query)
    if s.feed is None:
        raise invalid("only a background response created with stream: true can be streamed", "stream")
    return await follow(req, s.feed, after)


async def input_items(req: web.Request) -> web.Response:
    """A stored response's input items, a page at a time."""
    px = req.app[PROXY]
    s = px.stored.get(req.match_info["id"], px.tenant(req.headers))
    if s is None:
        raise _no_response(req)
    return json_answer(conversations.page(msgspec.json.decode(s.inputs), req.query))


async def cancel_response(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    id, owner = req.match_info["id"], px.tenant(req.headers)
    s = px.stored.get(id, owner)
    if s is None:
        raise _no_response(req)
    task = px.running.get(id)
    if task is None and not msgspec.json.decode(s.body).get("background"):
        raise invalid("only a background response can be cancelled", "response_id")
    if task is not None:
        task.cancel()
        await asyncio.wait([task])
        s = px.stored.get(id, owner) or s
    return web.Response(body=s.body, content_type="application/json")


async def delete_response(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    id = req.match_info["id"]
    if not px.stored.delete(id, px.tenant(req.headers)):
        raise _no_response(req)
    return json_answer({"id": id, "object": "response.deleted", "deleted": True})


def _no_response(req: web.Request) -> ApiError:
    return ApiError(404, f"Response with id {req.match_info['id']!r} not found.", "response_id",
                    "response_not_found")


@tracked("completions")
async def completions(req: web.Request) -> web.StreamResponse:
    px = req.app[PROXY]
    body = schemas.decode(await req.read(), schemas.CompletionRequest)
    call = px.call("completion", body, req.headers, req[T0])
    prompts, sampling = schemas.check_completion(body, px.backend.info)
    sampling.think_budget = reasoning.budget(px.config.reasoning, px.backend, body.thinking_token_budget)
    call.check_agents(len(prompts))
    if body.echo:
        call.echo = echo.make(prompts, body.n, body.max_tokens == 0, body.logprobs or 0,
                              getattr(px.backend, "tokenizer", None))
    known = px.place(call)
    segmented = [p if isinstance(p, list) else segment.text(p, call.meta.separators, known)
                 for p in prompts]
    px.prepare(call, segmented, sampling, body.add_special_tokens)
    streams = await px.admit(call)
    return await reply(req, px, call, streams)


@tracked("embeddings")
async def embeddings(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), vectors.EmbeddingRequest)
    out = await vectors.embed(req.app[PROXY], body, req.headers)
    return out.response() if isinstance(out, vectors.Binary) else json_answer(out, out.id)


@tracked("pooling")
async def pooling(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), vectors.PoolingRequest)
    out = await vectors.pooling(req.app[PROXY], body, req.headers)
    return out.response() if isinstance(out, vectors.Binary) else json_answer(out, out.id)


@tracked("score")
async def score(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), scores.ScoreRequest)
    out = await scores.score(req.app[PROXY], body, req.headers)
    return json_answer(out, out.id)


@tracked("rerank")
async def rerank(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), scores.RerankRequest)
    out = await scores.rerank(req.app[PROXY], body, req.headers)
    return json_answer(out, out.id)


@tracked("generative_scoring")
async def generative_scoring(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), generative.GenerativeScoring)
    out = await generative.score(req.app[PROXY], body, req.headers)
    return json_answer(out, out.id)


async def models(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    return json_answer(replies.ModelList([_card(px, name) for name in px.names]))


async def model(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    px.served(req.match_info["model"])
    return json_answer(_card(px, req.match_info["model"]))


def _card(px: Proxy, name: str) -> replies.ModelCard:
    info = px.backend.info
    return replies.ModelCard(name, int(px.started), info.max_model_len, info.name)


async def tokenize(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), tokens.TokenizeRequest)
    return json_answer(tokens.tokenize(req.app[PROXY], body))


async def detokenize(req: web.Request) -> web.Response:
    body = schemas.decode(await req.read(), tokens.DetokenizeRequest)
    return json_answer(tokens.detokenize(req.app[PROXY], body))


async def health(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    if px.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    problem = px.backend.problem()
    if problem is not None:
        raise ApiError(503, problem, code="backend_unavailable")
    return json_answer({"status": "ok", "model": px.names[0], "in_flight": px.in_flight})


async def load(req: web.Request) -> web.Response:
    """vLLM's server load: the requests in flight (what a load balancer spreads by)."""
    return json_answer({"server_load": req.app[PROXY].in_flight})


async def version(req: web.Request) -> web.Response:
    return json_answer({"version": VERSION})


async def metrics(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    px.metrics.waiting.set(px.barrier.waiting)
    px.metrics.stored.set(len(px.stored.items))
    px.metrics.stored_bytes.set(px.stored.bytes)
    control = req.app[CONTROL]
    if control is not None:
        px.metrics.mqtt.set(float(control.connected))
    return web.Response(text=px.metrics.render(px.backend.gauges()), content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def open_round(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    data = await req.read()
    body = schemas.decode(data, schemas.RoundOpen) if data.strip() else schemas.RoundOpen()
    if body.api_key is not None:
        raise invalid("api_key names an MQTT message's owner; over HTTP, send the key as "
                      "Authorization: Bearer", "api_key")
    return json_answer(px.open(req.match_info["session"], _number(req), body, px.owner(req.headers)).view())


async def seal_round(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    return json_answer(px.seal(req.match_info["session"], _number(req), px.owner(req.headers)).view())


async def round_stats(req: web.Request) -> web.Response:
    px = req.app[PROXY]
    rnd = px.sessions.find(req.match_info["session"], _number(req), px.owner(req.headers))
    if rnd is None:
        raise ApiError(404, "no such round", "round", "round_not_found")
    return json_answer(rnd.view())


async def invocations(req: web.Request) -> web.StreamResponse:
    """SageMaker's one route, as vLLM serves it: the body's fields choose the API (a chat's
    messages first, as vLLM tries its request types in that order)."""
    try:
        # only which fields are present: their values stay raw bytes, the handler decodes them
        given = msgspec.json.decode(await req.read(), type=Present)
    except msgspec.DecodeError as exc:
        if not isinstance(exc, msgspec.ValidationError):
            raise invalid(f"the body is not valid JSON: {exc}") from exc
    else:
        for fields, handler in INVOCATIONS:
            if any(getattr(given, f) for f in fields):
                return await handler(req)
    raise invalid("/invocations takes a chat (messages), a completion (prompt), embeddings (input), a "
                  "rerank (query) or a score (queries, data_1, text_1, items)")


def _number(req: web.Request) -> int:
    return round_number(req.match_info["round"], "round")


INVOCATIONS = ((("messages",), chat_completions), (("prompt",), completions), (("input",), embeddings),
               (("query",), rerank), (("queries", "data_1", "text_1", "items"), score))
# The fields /invocations routes by, left undecoded: an empty Raw is an absent field
Present = msgspec.defstruct("Present", [(f, msgspec.Raw, msgspec.Raw()) for fields, _ in INVOCATIONS for f in fields])


def make_app(proxy: Proxy, control: Control | None = None) -> web.Application:
    """The proxy's routes; the caller keeps `proxy` and `control` alive (a Server does)."""
    policy = proxy.config.cors
    app = web.Application(middlewares=[middleware, cors.preflights(policy), keys(proxy.config.api_keys)],
                          client_max_size=64 * 2**20)
    cors.answer(app, policy)
    # The app holds them weakly (the Server holds them): aiohttp caches every app's
    # middleware chain for the life of the process, so whatever an app holds strongly,
    # a stopped server's engine with its weights and KV included, would never be freed.
    px = weakref.proxy(proxy)
    app[PROXY] = px
    app[CONTROL] = control and weakref.proxy(control)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/chat/completions/batch", chat_batch)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", create_response)
    r.add_get("/v1/responses/{id}", get_response)
    r.add_get("/v1/responses/{id}/input_items", input_items)
    r.add_post("/v1/responses/{id}/cancel", cancel_response)
    r.add_delete("/v1/responses/{id}", delete_response)
    r.add_post("/v1/embeddings", embeddings)
    r.add_post("/pooling", pooling)
    for path in ("/score", "/v1/score"):
        r.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r.add_post(path, rerank)
    r.add_post("/generative_scoring", generative_scoring)
    conversations.routes(r, px)
    messages.routes(r)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model:.+}", model)  # a served path keeps its slashes
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_get("/health", health)
    r.add_get("/ping", health)  # SageMaker's health check, as vLLM answers it
    r.add_post("/ping", health)
    r.add_post("/invocations", invocations)  # SageMaker's, beside /ping
    r.add_get("/load", load)
    r.add_get("/version", version)
    r.add_get("/metrics", metrics)
    rounds = "/v1/tokendance/sessions/{session}/rounds/{round}"
    r.add_post(rounds, open_round)
    r.add_get(rounds, round_stats)
    r.add_post(rounds + "/seal", seal_round)
    return app
