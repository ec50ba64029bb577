"""The HTTP layer: FastAPI routes of the OpenAI-compatible API and the loader endpoints over an `Engine`."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .core_client import ModelCard
from .engine import Engine
from .errors import ServiceError
from .logprob_bodies import TokenTexts, chat_logprobs, completion_logprobs
from .text_stream import RequestStream
from .protocol import (ChatRequest, CompletionRequest, LoadRequest, chat_body, chat_chunk, completion_body,
                       error_body, new_id, usage)

OPEN_PATHS = ("/health",)  # answered without the API key (liveness probes)


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the engine and, on shutdown (after in-flight requests), drains and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await run_in_threadpool(engine.close)

    app = FastAPI(title="devmap serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_Observed, engine=engine, api_key=api_key)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid" and len(loc) == 2:  # its place is a character of the body, not a field
            reason = (first.get("ctx") or {}).get("error", "an error")
            where, text = None, f"the body is not valid JSON ({reason} at character {loc[-1]})"
        elif loc == ("body",):
            where, text = None, "the body must be a JSON object, sent as content-type: application/json"
        else:
            where = ".".join(str(p) for p in loc if p != "body")
            message = first.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's, of a validator
            text = f"{where}: {message}" if where else message
        return JSONResponse(error_body(text, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code)

    # the models' calls go to the engine core (perhaps another process) from a worker thread: the event loop keeps
    # streaming meanwhile
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": [m["id"] for m in await run_in_threadpool(engine.models)]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await run_in_threadpool(engine.render_metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await run_in_threadpool(engine.models)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return await run_in_threadpool(engine.describe, model_id)

    @app.post("/v1/models/load")
    async def load(body: LoadRequest) -> dict[str, Any]:
        return await run_in_threadpool(engine.load, body.model, body.id, body.device_map, body.max_memory,
                                       body.dtype)

    @app.delete("/v1/models/{model_id:path}")
    async def unload(model_id: str) -> dict[str, Any]:
        await run_in_threadpool(engine.unload, model_id)
        return {"id": model_id, "object": "model", "deleted": True}

    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        return await run_in_threadpool(engine.start_profile)

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        return await run_in_threadpool(engine.stop_profile)

    # a prompt's tokenizing (and a chat's template) runs off the event loop: a megabyte of text takes a second to
    # tokenize, in which no stream of any client would move
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        card, ids, echoed = await run_in_threadpool(_completion_prompt, engine, body)
        job = engine.submit(body.model, ids, body.params())
        request_id = new_id("cmpl")
        scores = _CompletionScores(card.tokenizer, job, body.echo, len(echoed)) if body.logprobs is not None else None
        if body.stream:
            return _sse(_completion_events(engine, job, request_id, body.model, echoed, scores))
        text = "".join([piece async for piece in engine.stream(job)])
        return completion_body(request_id, body.model, echoed + text, job.finish_reason,
                               usage(len(job.prompt_ids), len(job.generated)), scores and scores.new())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        tokenizer, ids = await run_in_threadpool(_chat_prompt, engine, body)
        job = engine.submit(body.model, ids, body.params())
        request_id = new_id("chatcmpl")
        scores = _ChatScores(tokenizer, job) if body.logprobs else None
        if body.stream:
            return _sse(_chat_events(engine, job, request_id, body.model, scores))
        text = "".join([piece async for piece in engine.stream(job)])
        return chat_body(request_id, body.model, text, job.finish_reason or "stop",
                         usage(len(job.prompt_ids), len(job.generated)), scores and scores.new())

    return app


def _completion_prompt(engine: Engine, body: CompletionRequest) -> tuple[ModelCard, list[int], str]:
    """The model's card, the prompt's token ids and the text an `echo` gives back (blocks: tokenizes)."""
    card, prompt = engine.card(body.model), body.prompt
    ids = prompt if isinstance(prompt, list) else card.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    echoed = (prompt if isinstance(prompt, str) else card.tokenizer.decode(ids)) if body.echo else ""
    return card, ids, echoed


def _chat_prompt(engine: Engine, body: ChatRequest) -> tuple[Any, list[int]]:
    """The model's tokenizer and the token ids of the conversation in its chat template (blocks: tokenizes)."""
    tokenizer = engine.card(body.model).tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ServiceError(f"model {body.model!r} has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"]


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_events(engine: Engine, job: RequestStream, request_id: str, model: str, echoed: str,
                             scores: _CompletionScores | None) -> AsyncIterator[dict]:
    echo = bool(echoed)  # the echoed prompt goes first, once its scores came (with or before the first text)
    try:
        async for piece in engine.stream(job):
            if echo:
                echo = False
                yield completion_body(request_id, model, echoed, None, None, scores and scores.prompt())
            yield completion_body(request_id, model, piece, None, None, scores and scores.new())
    except ServiceError as exc:  # headers are sent: the error goes in the stream, as OpenAI's servers do
        yield error_body(exc.message, exc.kind, exc.param)
        return
    if echo:
        yield completion_body(request_id, model, echoed, None, None, scores and scores.prompt())
    yield completion_body(request_id, model, "", job.finish_reason, usage(len(job.prompt_ids), len(job.generated)),
                          scores and scores.new())


async def _chat_events(engine: Engine, job: RequestStream, request_id: str, model: str,
                       scores: _ChatScores | None) -> AsyncIterator[dict]:
    yield chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None)
    try:
        async for piece in engine.stream(job):
            yield chat_chunk(request_id, model, {"content": piece}, None, scores and scores.new())
    except ServiceError as exc:
        yield error_body(exc.message, exc.kind, exc.param)
        return
    final = chat_chunk(request_id, model, {}, job.finish_reason or "stop", scores and scores.new())
    final["usage"] = usage(len(job.prompt_ids), len(job.generated))
    yield final


class _ChatScores:
    """A chat request's token scores as they arrive: `new()` gives those not yet sent, in the chat API's shape."""

    def __init__(self, tokenizer: Any, job: RequestStream) -> None:
        self.texts, self.job = TokenTexts(tokenizer), job

    def new(self) -> dict:
        job, sent = self.job, self.job.scores_sent
        job.scores_sent = len(job.scores)
        before = job.generated[sent - 1] if sent else job.prompt_ids[-1]
        return chat_logprobs(self.texts, job.generated[sent:job.scores_sent], job.scores[sent:job.scores_sent],
                             before)


class _CompletionScores:
    """A completion's token scores as they arrive, in the completions API's shape: `prompt()` the echoed prompt's
    (where the request asked for echo), `new()` those not yet sent (the prompt's first, unless `prompt()` sent
    them), their text offsets counted from the choice's text (the echoed prompt's `offset` characters first)."""

    def __init__(self, tokenizer: Any, job: RequestStream, echo: bool, offset: int) -> None:
        self.texts, self.job, self.echo, self.offset = TokenTexts(tokenizer), job, echo, offset
        self.prompt_sent = not echo

    def prompt(self) -> dict:
        self.prompt_sent = True
        ids = self.job.prompt_ids
        return completion_logprobs(self.texts, ids, self.job.prompt_scores or [None] * len(ids))

    def new(self) -> dict:
        head = None if self.prompt_sent else self.prompt()
        job, sent = self.job, self.job.scores_sent
        job.scores_sent = len(job.scores)
        before = job.generated[sent - 1] if sent else job.prompt_ids[-1]
        ids = job.generated[sent:job.scores_sent]
        body = completion_logprobs(self.texts, ids, job.scores[sent:job.scores_sent], before, self.offset)
        self.offset = body["text_offset"][-1] + len(body["tokens"][-1]) if ids else self.offset
        if head is not None:
            body = {key: head[key] + body[key] for key in body}
        return body


class _Observed:
    """ASGI middleware: the API key check, and per-request metrics (status, latency to the last byte)."""

    def __init__(self, app: ASGIApp, engine: Engine, api_key: str | None) -> None:
        self.app, self.engine, self.api_key = app, engine, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if not path.startswith("/v1/models/") else "/v1/models/{id}"
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            response = JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                               "authentication_error"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            self.engine.metrics.requests.labels(endpoint=endpoint, status="401").inc()
            await response(scope, receive, send)
            return
        limit = self.engine.limits.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, receive, send, endpoint, int(declared), limit)
            return
        start = time.perf_counter()
        status = {"code": 500}
        received = {"bytes": 0}

        async def bounded() -> Message:  # a body sent without a length (chunked) is counted as it comes
            message = await receive()
            if message["type"] == "http.request":
                received["bytes"] += len(message.get("body", b""))
                if received["bytes"] > limit:  # the app's error handler answers it (413)
                    raise StarletteHTTPException(413, self._too_large_message(received["bytes"], limit, True))
            return message

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.engine.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - start)

        try:
            await self.app(scope, bounded, observed)
        finally:
            self.engine.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, endpoint: str, size: int,
                         limit: int) -> None:
        """413 before the body is read."""
        response = JSONResponse(error_body(self._too_large_message(size, limit), "invalid_request_error"),
                                status_code=413)
        self.engine.metrics.requests.labels(endpoint=endpoint, status="413").inc()
        await response(scope, receive, send)

    def _too_large_message(self, size: int, limit: int, at_least: bool = False) -> str:
        tokens = self.engine.limits.max_prompt_tokens
        return (f"the request body is {'more than ' if at_least else ''}{size:,} bytes; this service reads at most "
                f"{limit:,} (1 MiB + 64 bytes for each of --max-prompt-tokens {tokens}): send a shorter prompt, or "
                "start the service with a larger --max-prompt-tokens")

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.api_key or "")


