"""LoRA adapters on the server: the names clients select them by (the request's ``model``
field), their cards in ``/v1/models``, and vLLM's routes to load and unload them at run time:
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with ``{"lora_name",
"lora_path"}`` bodies.

The server gives each adapter name its own ``lora_int_id`` (never reused, so KV blocks cached
under an unloaded adapter are never served to a new adapter of the same name).
"""
from __future__ import annotations

import asyncio
import itertools

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagellm.core.async_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.errors import APIError, api_error_from_exception
from pagellm.entrypoints.openai.protocol import ModelCard
from pagellm.entrypoints.openai.request_body import BodyParser
from pagellm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    """The served adapters by name. Invariant: every adapter listed is registered in the
    engine; ids only grow."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def add_at_start(self, modules: list[tuple[str, str]], served_names: list[str]) -> None:
        """``--lora-modules``: register before the engine loop starts (a bad adapter stops the
        server at start-up with its error)."""
        for name, path in modules:
            if name in self.by_name or name in served_names:
                raise ValueError(f"--lora-modules: the model name {name!r} is already in use")
            request = LoRARequest(name, next(self._ids), path)
            self.engine.engine.add_lora(request)
            self.by_name[name] = request

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)

    def cards(self, base_name: str, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=request.lora_path, parent=base_name,
                          max_model_len=max_model_len)
                for name, request in self.by_name.items()]

    async def load(self, body: LoadLoRAAdapterRequest, served_names: list[str]) -> str:
        async with self._lock:
            if body.lora_name in self.by_name or body.lora_name in served_names:
                raise APIError(f"the model name {body.lora_name!r} is already in use", 400,
                               "lora_name")
            try:
                request = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
                await self.engine.run_on_engine(self.engine.engine.add_lora, request)
            except ValueError as exc:
                raise api_error_from_exception(exc) from exc
            self.by_name[body.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        async with self._lock:
            request = self.by_name.get(body.lora_name)
            if request is None or body.lora_int_id not in (None, request.lora_int_id):
                raise APIError(f"the LoRA adapter {body.lora_name!r} is not loaded", 404,
                               "lora_name", "model_not_found")
            del self.by_name[body.lora_name]
            await self.engine.run_on_engine(self.engine.engine.remove_lora,
                                            request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def add_lora_routes(app: FastAPI, loras: LoRAModels | None, served_names: list[str],
                    bodies: BodyParser) -> None:
    def enabled() -> LoRAModels:
        if loras is None:
            raise APIError("LoRA adapters are not enabled: start the server with "
                           "--enable-lora", 400)
        return loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest = bodies.dependency(
            LoadLoRAAdapterRequest)) -> PlainTextResponse:
        return PlainTextResponse(await enabled().load(body, served_names))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest = bodies.dependency(
            UnloadLoRAAdapterRequest)) -> PlainTextResponse:
        return PlainTextResponse(await enabled().unload(body))
