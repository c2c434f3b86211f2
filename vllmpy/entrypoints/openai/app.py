"""The OpenAI-compatible HTTP app over AsyncLLM: routes, error shapes, the request guard.

Every failure answers in OpenAI's error shape. ``vllm-server`` (api_server.py) builds it
once the engine is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import platform
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

import vllmpy
from vllmpy.engine.async_llm import AsyncLLM
from vllmpy.engine.configure import kv_cache_dtype_name
from vllmpy.entrypoints.openai.cli_args import resolve_output_parsers
from vllmpy.entrypoints.openai.errors import OpenAIError, error_body
from vllmpy.entrypoints.openai.multimodal_limits import request_limits
from vllmpy.entrypoints.openai.openapi import document
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vllmpy.entrypoints.openai.serving_chat import ChatHandler
from vllmpy.entrypoints.openai.serving_classify import ClassifyHandler
from vllmpy.entrypoints.openai.serving_common import (
    ClientDisconnected,
    ServerContext,
    as_openai_error,
    parse_body,
    until_disconnected,
    with_keepalive,
)
from vllmpy.entrypoints.openai.serving_completion import CompletionHandler
from vllmpy.entrypoints.openai.serving_embedding import EmbeddingHandler
from vllmpy.entrypoints.openai.serving_pooling import PoolingHandler, check_task
from vllmpy.entrypoints.openai.serving_score import ScoreHandler
from vllmpy.entrypoints.openai.serving_tokenization import TokenizationHandler
from vllmpy.entrypoints.openai.web_ui import add_web_ui, is_web_ui_path
from vllmpy.pooling import model_tasks

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Routes a supervisor or a scraper reads: open without the API key, and still answering
# once the engine is dead (/health then says so).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


class RequestGuard:
    """Refuses, before any route runs: a body over the size limit (413); any route but
    ``OPEN_PATHS`` once the engine core is dead (503: the server is going down and serves
    nothing); a request without the API key on any route but ``OPEN_PATHS``, the web UI's
    pages (when served: they ask for the key themselves) and CORS preflights (401; the key
    is compared in constant time). A plain ASGI middleware:
    Starlette's ``@app.middleware("http")`` would pass every streamed chunk through an
    extra memory stream, which costs more than the rest of a token's trip through the
    server."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None,
                 engine: AsyncLLM | None = None, web_ui: bool = False) -> None:
        self.app = app
        self.web_ui = web_ui
        self.max_body_bytes = max_body_bytes
        self.expected_auth = None if not api_key else f"Bearer {api_key}".encode()
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _error(413, f"request body of {length} bytes exceeds the limit of "
                               f"{self.max_body_bytes} bytes")
        if scope["path"] in OPEN_PATHS:
            return None
        if self.engine is not None and self.engine.is_dead:
            return _error(503, f"the engine has stopped: {self.engine.dead_error}; the "
                               f"server is shutting down")
        if self.web_ui and is_web_ui_path(scope["path"]):
            return None
        if self.expected_auth is not None and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected_auth):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer "
                                   "<key>'")
        return None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def build_app(engine: AsyncLLM, args: argparse.Namespace, served_model_name: str,
              on_engine_dead: Callable[[], None] | None = None) -> FastAPI:
    """The app over ``engine``. When the engine core dies, ``on_engine_dead`` is called
    once the requests in flight have ended (or after ``DEAD_ENGINE_GRACE_S``): the server
    then exits non-zero, so a supervisor restarts it."""
    tool_parser, reasoning_parser = resolve_output_parsers(
        args, getattr(engine.tokenizer, "chat_template", None))
    ctx = ServerContext(
        engine=engine,
        served_model_name=served_model_name,
        max_model_len=engine.model_config.max_model_len,
        force_include_usage=args.enable_force_include_usage,
        default_chat_template_kwargs=({} if args.enable_thinking is None
                                      else {"enable_thinking": args.enable_thinking}),
        log_requests=args.log_requests,
        log_outputs=args.enable_log_outputs,
        max_log_len=args.max_log_len,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        mm_limits=args.mm_limits,
    )
    completions, chat = CompletionHandler(ctx), ChatHandler(ctx)
    tokenization = TokenizationHandler(ctx)
    embeddings, pooling = EmbeddingHandler(ctx), PoolingHandler(ctx)
    classify, scores = ClassifyHandler(ctx), ScoreHandler(ctx)
    tasks = list(model_tasks(engine.model_config))
    metrics = None
    if args.enable_metrics:
        from vllmpy.metrics.prometheus import PrometheusStatLogger

        metrics = PrometheusStatLogger(served_model_name, ctx.max_model_len)
        engine.stat_listeners.append(metrics.listener)
    history = None
    if metrics is not None and args.enable_web_ui:
        from vllmpy.metrics.history import MetricsHistory

        history = MetricsHistory(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.ensure_future(watch_engine(engine, metrics, on_engine_dead))]
        if history is not None:
            tasks.append(asyncio.ensure_future(history.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    app = FastAPI(title="vllmpy", version=vllmpy.__version__, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.max_body_bytes = args.max_request_body_bytes  # read_body's limit
    app.add_middleware(RequestGuard, max_body_bytes=args.max_request_body_bytes,
                       api_key=args.api_key, engine=engine, web_ui=args.enable_web_ui)
    if args.allowed_origins:  # outermost: preflights pass, and refusals carry the headers
        origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=True)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error(e.status_code, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            return _error(404, f"no route {request.method} {request.url.path}")
        if e.status_code == 405:  # keeps Starlette's Allow header
            response = _error(405, f"method {request.method} is not allowed on "
                                   f"{request.url.path}")
            response.headers.update(e.headers or {})
            return response
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {e.errors()}")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        error = as_openai_error(e)
        return _error(error.status_code, error.message, error.param)

    async def answer(raw: Request, work) -> Response:
        """The JSON body ``work`` makes; a client gone first cancels it (499)."""
        try:
            body = await until_disconnected(raw, work)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(body)

    async def run_or_stream(raw: Request, handler, req) -> Response:
        check_task(ctx, "generate")  # a pooling model's 400 names its tasks
        if not req.stream:
            return await answer(raw, handler.full(req))
        prepared = handler.prepare(req, stream=True)
        frames = handler.stream(req, *prepared)
        return StreamingResponse(with_keepalive(frames), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        return await run_or_stream(raw, completions, await parse_body(raw, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        with request_limits(ctx.mm_limits):  # a multimodal part's 400 names the limit
            req = await parse_body(raw, ChatCompletionRequest)
        return await run_or_stream(raw, chat, req)

    @app.post("/v1/embeddings")
    async def create_embedding(raw: Request) -> Response:
        return await answer(raw, embeddings.full(await parse_body(raw, EmbeddingRequest)))

    @app.post("/pooling")
    async def create_pooling(raw: Request) -> Response:
        return await answer(raw, pooling.full(await parse_body(raw, PoolingRequest)))

    @app.post("/classify")
    async def create_classify(raw: Request) -> Response:
        return await answer(raw, classify.full(await parse_body(raw, ClassificationRequest)))

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(raw: Request) -> Response:
        return await answer(raw, scores.score(await parse_body(raw, ScoreRequest)))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(raw: Request) -> Response:
        return await answer(raw, scores.rerank(await parse_body(raw, RerankRequest)))

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=served_model_name, created=int(START_TIME),
                         root=engine.model_config.model, max_model_len=ctx.max_model_len,
                         task=tasks[0], tasks=tasks)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:  # noqa: BLE001 - a dead engine is a failed health check
            return _error(503, f"engine is not healthy: {e}")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.post("/ping")
    async def ping_post() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllmpy.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return _error(404, "metrics are disabled (--disable-metrics)")
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        return JSONResponse(await tokenization.tokenize(raw))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        return JSONResponse(await tokenization.detokenize(raw))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.info())

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(_server_info(engine, args, served_model_name))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return JSONResponse({"success": bool(await engine.reset_prefix_cache())})

    if args.enable_web_ui:
        add_web_ui(app, history, _error)

    document(app, {"/v1/completions": [CompletionRequest],
                   "/v1/chat/completions": [ChatCompletionRequest],
                   "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
                   "/detokenize": [DetokenizeRequest],
                   "/v1/embeddings": [EmbeddingRequest], "/pooling": [PoolingRequest],
                   "/classify": [ClassificationRequest],
                   **dict.fromkeys(("/score", "/v1/score"), [ScoreRequest]),
                   **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), [RerankRequest])})
    return app


START_TIME = time.time()
# How often the watchdog checks the engine core, and how long a dead engine's requests in
# flight get to end with their error before the server exits.
ENGINE_WATCH_S = 0.2
DEAD_ENGINE_GRACE_S = 2.0


async def watch_engine(engine: AsyncLLM, metrics: Any,
                       on_engine_dead: Callable[[], None] | None) -> None:
    """Wait for the engine core to die; then zero the gauges (nothing runs any more), let
    the requests in flight end with their error, and call ``on_engine_dead``."""
    while not engine.is_dead:
        await asyncio.sleep(ENGINE_WATCH_S)
    print(f"server: the engine core has died ({engine.dead_error}); failing the requests in "
          f"flight and shutting down", file=sys.stderr, flush=True)
    if metrics is not None:
        metrics.engine_stopped()
    deadline = time.monotonic() + DEAD_ENGINE_GRACE_S
    while engine.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if on_engine_dead is not None:
        on_engine_dead()


def _server_info(engine: AsyncLLM, args: argparse.Namespace, name: str) -> dict[str, Any]:
    cfg = engine.config
    return {
        "vllm_config": {
            "served_model_name": name, "model": cfg.model.model, "source": cfg.model.source_kind,
            "architectures": cfg.model.text_config.architectures,
            "dtype": str(cfg.model.dtype).removeprefix("torch."),
            "max_model_len": cfg.model.max_model_len, "block_size": cfg.cache.block_size,
            "num_blocks": cfg.cache.num_blocks,
            "kv_cache_dtype": kv_cache_dtype_name(cfg.cache.kv_cache_dtype),
            "kv_cache_dtype_requested": cfg.cache.kv_cache_dtype_requested,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "scheduling_policy": cfg.scheduler.policy,
            "device": cfg.device,
            "speculative_config": (None if cfg.speculative is None
                                   else dataclasses.asdict(cfg.speculative)),
        },
        "vllm_env": {"version": vllmpy.__version__},
        "system_env": {"python": platform.python_version(), "platform": platform.platform()},
    }


def startup_lines(engine: AsyncLLM, name: str) -> None:
    cfg = engine.config
    print(f"server: model {cfg.model.model!r} ({', '.join(cfg.model.text_config.architectures)}, "
          f"dtype {str(cfg.model.dtype).removeprefix('torch.')}, device {cfg.device}) served as "
          f"{name!r}", file=sys.stderr)
    fitted = " (auto-fitted; --max-model-len sets it)" if cfg.model.max_model_len_fitted else ""
    print(f"server: max_model_len {cfg.model.max_model_len}{fitted}; KV pool "
          f"{cfg.cache.num_blocks} "
          f"blocks x {cfg.cache.block_size} tokens = {cfg.cache.num_tokens} tokens, "
          f"{cfg.cache.num_blocks * cfg.cache.bytes_per_block} bytes", file=sys.stderr)
