"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, run by uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (``/v1/embeddings``
answers 404 in OpenAI's error format: no embedding models), ``/version``, and ``/health``,
``/metrics`` (Prometheus), ``/stats`` (a JSON snapshot of the engine and its KV cache),
``/stats/blocks`` (the block map with the request ids holding each block),
``/tokenize``, ``/detokenize``, and ``/dashboard``, the page that draws the block map live
(static files, no data: the page asks for the key when the server has one). With API keys
set, every route but ``/health`` and the dashboard's files demands one: ``/metrics`` and
``/stats`` too, since their prefix-cache counters tell whether someone else sent a prompt.
``/stats`` names no request: a request id is seen only by its own client, and by whoever
holds a key for ``/stats/blocks``.

What one client may cost is bounded (``ServerConfig``): the body size, the time to send the
request head and the body, the number of connections, and, through the body parser
(request_body.py) and the tokenizer worker (tokenization.py), the time the event loop spends
on its JSON and its text.

Shutdown on SIGINT/SIGTERM: new requests get 503, requests in flight are aborted (their streams
end at once and their KV blocks are freed), uvicorn closes the connections, then the engine loop
stops and the process exits with status 0.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagellm import __version__, dashboard
from pagellm.core.async_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.errors import APIError, APIKeyMiddleware, install_error_handlers
from pagellm.entrypoints.openai.http_guard import RequestBodyGuard, guarded_h11_protocol
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, ModelCard, ModelList,
                                                 TokenizeRequest)
from pagellm.entrypoints.openai.request_body import BodyParser
from pagellm.entrypoints.openai.server_config import ServerConfig
from pagellm.entrypoints.openai.serving import ServerContext
from pagellm.entrypoints.openai.tokenization import TokenizerWorker, own_copy
from pagellm.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from pagellm.entrypoints.openai.serving_completion import create_completion
from pagellm.entrypoints.openai.serving_lora import LoRAModels, add_lora_routes
from pagellm.metrics import EngineMetrics

logger = logging.getLogger("pagellm")

def build_app(engine: AsyncLLMEngine, served_model_names: list[str], metrics: EngineMetrics,
              config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; the engine loop starts with the app and stops with it. With LoRA
    enabled, ``config.lora_modules`` are registered before the loop starts."""
    config = config or ServerConfig()
    ctx = ServerContext(engine=engine, tokenizer=own_copy(engine.tokenizer),
                        tokenization=TokenizerWorker(engine.tokenizer, engine.max_model_len),
                        served_model_names=list(served_model_names),
                        max_model_len=engine.max_model_len,
                        prefix_cache_isolation=config.prefix_cache_isolation,
                        loras=_lora_models(engine, config, served_model_names),
                        system_fingerprint=_fingerprint(engine),
                        chat=config)
    bodies = BodyParser(config.max_request_json_objects)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            ctx.tokenization.shutdown()
            bodies.shutdown()

    app = FastAPI(title="pagellm OpenAI-compatible server", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:  # outermost: a preflight needs no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"], allow_credentials=False)
    app.add_middleware(RequestBodyGuard, max_bytes=config.max_request_body_bytes,
                       timeout_s=config.body_timeout_s)
    _add_openai_routes(app, ctx, bodies)
    add_lora_routes(app, ctx.loras, ctx.served_model_names, bodies)
    _add_server_routes(app, ctx, metrics, bodies)
    bodies.install_openapi(app)
    return app


def _fingerprint(engine: AsyncLLMEngine) -> str:
    """OpenAI's ``system_fingerprint``: changes when the version, model or dtype does."""
    args = getattr(engine, "args", None) or getattr(getattr(engine, "engine", None), "args",
                                                     None)
    text = f"{__version__}|{getattr(args, 'model', '')}|{getattr(args, 'dtype', '')}"
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:10]


def _add_openai_routes(app: FastAPI, ctx: ServerContext, bodies: BodyParser) -> None:
    @app.post("/v1/completions")
    async def completions(raw: Request, body: CompletionRequest = bodies.dependency(
            CompletionRequest)):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, body: ChatCompletionRequest = bodies.dependency(
            ChatCompletionRequest)):
        return await create_chat_completion(ctx, body, raw)

    @app.post("/v1/embeddings")
    async def embeddings():
        raise APIError(f"the model '{ctx.model_name}' does not support embeddings: pagellm "
                       "serves generative models only (/v1/completions, "
                       "/v1/chat/completions)", 404, "model", "model_not_supported")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=name, max_model_len=ctx.max_model_len)
                 for name in ctx.served_model_names]
        if ctx.loras is not None:
            cards += ctx.loras.cards(ctx.model_name, ctx.max_model_len)
        return ModelList(data=cards).model_dump(mode="json")


def _lora_models(engine: AsyncLLMEngine, config: ServerConfig,
                 served_model_names: list[str]) -> LoRAModels | None:
    if not getattr(getattr(engine.engine, "args", None), "enable_lora", False):
        if config.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    loras = LoRAModels(engine)
    loras.add_at_start(list(config.lora_modules), list(served_model_names))
    return loras


def _add_server_routes(app: FastAPI, ctx: ServerContext, metrics: EngineMetrics,
                       bodies: BodyParser) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            raise APIError("the engine is not running", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict:
        snapshot = ctx.engine.get_stats().to_dict()
        snapshot["num_used_blocks"] = snapshot["num_blocks"] - snapshot["num_free_blocks"]
        snapshot["num_requests_in_flight"] = ctx.engine.num_streams()
        # blocks held per sequence, largest first: the ids belong to other clients
        snapshot["seq_block_counts"] = sorted(snapshot["seq_block_counts"].values(),
                                              reverse=True)
        return snapshot

    encoded: dict[str, Any] = {"view": None, "body": ""}  # each view is encoded once

    @app.get("/stats/blocks")
    async def stats_blocks() -> Response:
        if not ctx.engine.is_running:
            raise APIError("the engine is not running", 503)
        view = await ctx.engine.get_kv_view()
        if encoded["view"] is not view:
            encoded["view"], encoded["body"] = view, json.dumps(view, separators=(",", ":"))
        return Response(encoded["body"], media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    _add_dashboard_routes(app)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest = bodies.dependency(TokenizeRequest)) -> dict:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400)
        if body.messages is not None:
            ids = await chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
        else:
            ids = await ctx.tokenization.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest = bodies.dependency(DetokenizeRequest)
                         ) -> dict:
        ctx.check_model(body.model)
        return {"prompt": await ctx.tokenization.decode(body.tokens, "tokens")}


def _add_dashboard_routes(app: FastAPI) -> None:
    media_types = {"html": "text/html", "js": "text/javascript", "css": "text/css"}

    def serve(name: str) -> Response:
        media_type = media_types[name.rsplit(".", 1)[1]]
        return Response(dashboard.asset(name), media_type=f"{media_type}; charset=utf-8")

    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return serve("dashboard.html")

    @app.get("/dashboard/{name}")
    async def dashboard_file(name: str) -> Response:
        if name not in dashboard.ASSETS:
            raise APIError(f"no dashboard file {name!r}", 404)
        return serve(name)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: on SIGINT/SIGTERM, abort the engine's requests in flight first,
    so that open streams end now instead of holding the graceful shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None and not self.loop.is_closed():
            # A signal handler must not take locks: hand the work to the event loop.
            self.loop.call_soon_threadsafe(self.engine.begin_shutdown)


def run_server(engine: AsyncLLMEngine, model_path: str, config: ServerConfig,
               metrics: EngineMetrics) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully and return."""
    names = list(config.served_model_names) or [model_path]
    app = build_app(engine, names, metrics, config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=config.timeout_graceful_shutdown,
                               http=guarded_h11_protocol(config.header_timeout_s),
                               timeout_keep_alive=config.timeout_keep_alive_s,
                               limit_concurrency=config.limit_concurrency)
    server = _Server(uv_config, engine)
    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown is
    # complete, so the re-raised signal is ignored and the caller returns normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    logger.info("server stopped")
