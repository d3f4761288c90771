"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, run by uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (all ``/v1`` routes behind
the API key when one is set), and ``/health``, ``/metrics`` (Prometheus), ``/stats`` (a JSON
snapshot of the engine and its KV cache), ``/tokenize``, ``/detokenize``.

Shutdown on SIGINT/SIGTERM: new requests get 503, requests in flight are aborted (their streams
end at once and their KV blocks are freed), uvicorn closes the connections, then the engine loop
stops and the process exits with status 0.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagellm.core.async_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.errors import (APIError, APIKeyMiddleware, BodySizeLimitMiddleware,
                                               install_error_handlers)
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, ModelCard, ModelList,
                                                 TokenizeRequest)
from pagellm.entrypoints.openai.serving import ServerContext
from pagellm.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from pagellm.entrypoints.openai.serving_completion import create_completion
from pagellm.metrics import EngineMetrics

logger = logging.getLogger("pagellm")

# Larger request bodies get 413 before they are read: far above any prompt that fits a
# context, far below what would hurt the server's memory.
MAX_REQUEST_BODY_BYTES = 16 << 20


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    uvicorn_log_level: str = "info"
    timeout_graceful_shutdown: float = 10.0


def build_app(engine: AsyncLLMEngine, model_path: str, served_model_names: list[str],
              metrics: EngineMetrics, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; the engine loop starts with the app and stops with it."""
    ctx = ServerContext(engine=engine, tokenizer=_own_tokenizer(engine.tokenizer),
                        served_model_names=list(served_model_names), model_path=model_path,
                        max_model_len=engine.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagellm OpenAI-compatible server", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_REQUEST_BODY_BYTES)
    _add_openai_routes(app, ctx)
    _add_server_routes(app, ctx, metrics)
    return app


def _own_tokenizer(tokenizer: Any) -> Any:
    """A copy for the event loop thread: the engine loop thread keeps the original."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an exotic tokenizer that cannot be copied
        logger.warning("could not copy the tokenizer; sharing it with the engine loop")
        return tokenizer


def _add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                 for name in ctx.served_model_names]
        return ModelList(data=cards).model_dump(mode="json")


def _add_server_routes(app: FastAPI, ctx: ServerContext, metrics: EngineMetrics) -> None:
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
        return snapshot

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400)
        if body.messages is not None:
            ids = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
        else:
            ids = list(ctx.tokenizer.encode(body.prompt,
                                            add_special_tokens=body.add_special_tokens))
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        vocab = len(ctx.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range [0, {vocab})", 400, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}


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
    app = build_app(engine, model_path, names, metrics, config.api_key)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.uvicorn_log_level,
                               timeout_graceful_shutdown=config.timeout_graceful_shutdown)
    server = _Server(uv_config, engine)
    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown is
    # complete, so the re-raised signal is ignored and the caller returns normally.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    logger.info("server stopped")
