"""A fake vLLM server for the proxy's vLLM backend tests: it speaks vLLM's streamed
/v1/completions (token ids in; text, token ids, logprobs by id, stop reasons and usage
out), /v1/embeddings and /v1/models, refuses what vLLM refuses, and records every body."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
from aiohttp import web


class FakeVLLM:
    def __init__(self, root: str, key: str | None = None):
        self.root = root
        self.key = key  # vLLM's --api-key: its /v1 routes answer 401 without it
        self.bodies: list[dict[str, Any]] = []
        self.cancelled = 0
        self.status = 200  # another: /v1/completions answers it with vLLM's error body
        # After this many tokens a stream breaks: "reset" drops the connection, "end" ends
        # the stream as if it were whole (no finish_reason)
        self.cut: tuple[int, str] | None = None

    @web.middleware
    async def _check(self, req: web.Request, handler) -> web.StreamResponse:
        if self.key and req.path.startswith("/v1") and req.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(req)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._check])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, req: web.Request) -> web.Response:
        return web.Response()

    async def models(self, req: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-vllm", "max_model_len": 4096, "root": self.root}]})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": f"failed with {self.status}"}}, status=self.status)
        if body["max_tokens"] > 100:
            return web.json_response({"error": {"message": "max_tokens is too large"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        n = body["max_tokens"]
        try:
            for i in range(n):
                if self.cut is not None and i == self.cut[0]:
                    if self.cut[1] == "reset":
                        req.transport.close()
                        return resp
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                last = i == n - 1  # a stop string "stop" ends it at its last token, as vLLM says
                stop = "stop" in (body.get("stop") or [])
                choice = {"index": 0, "text": f" w{i}", "token_ids": [100 + i],
                          "finish_reason": ("stop" if stop else "length") if last else None,
                          "stop_reason": "stop" if last and stop else None}
                if body.get("logprobs") is not None:  # as vLLM names them with return_tokens_as_token_ids
                    assert body["return_tokens_as_token_ids"]
                    top = {f"token_id:{100 + i}": -0.5, "token_id:7": -1.5}
                    if body.get("logprob_token_ids"):  # vLLM lists the sampled token, then these
                        assert body["logprobs"] == len(body["logprob_token_ids"])
                        top = {f"token_id:{100 + i}": -0.5,
                               **{f"token_id:{t}": -1 - t / 1000 for t in body["logprob_token_ids"]}}
                    choice["logprobs"] = {"tokens": [f"token_id:{100 + i}"], "token_logprobs": [-0.5],
                                          "top_logprobs": [top]}
                await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                await asyncio.sleep(0.01)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": 3}}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp


    async def embeddings(self, req: web.Request) -> web.Response:
        """A pooling server's answer: the ids' sum, count and first id; a generative one's
        refusal for an input that starts with id 0; vLLM 0.32's refusal of `normalize`."""
        body = await req.json()
        self.bodies.append(body)
        ids = body["input"]
        if "normalize" in body:
            return web.json_response({"error": {"message": "Parameter `normalize` was removed"}}, status=400)
        if ids[0] == 0:
            return web.json_response({"error": {"message": "The model does not support Embeddings API"}},
                                     status=400)
        return web.json_response({"data": [{"index": 0, "object": "embedding",
                                            "embedding": [float(sum(ids)), float(len(ids)), float(ids[0])]}],
                                  "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids)}})


async def served(fake: FakeVLLM, port: int = 0) -> FakeVLLM:
    runner = web.AppRunner(fake.app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fake.runner = runner
    return fake


def client(server: Any, key: str = "sk-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def vllm_vector(ids: list[int]) -> list[float]:
    return [float(sum(ids)), float(len(ids)), float(ids[0])]  # as the fake server embeds
