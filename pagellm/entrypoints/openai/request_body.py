"""Request bodies parsed and validated without stalling the event loop.

FastAPI decodes a route's JSON body and validates it with pydantic on the event loop. A body
near the size limit (16 MiB by default) of many small parts, e.g. 300,000 chat messages, took
seconds of that (about 6 us per message to validate), during which no other client's stream
moved and even ``/health`` waited. Moving the work to a thread alone does not help: pydantic
validates a whole request in one call into compiled code that keeps the interpreter lock
throughout. So routes take their body from ``BodyParser.dependency(Model)``:

- bodies up to ``INLINE_BYTES`` are parsed in place (a thread hop would cost more than they
  do); larger ones on one worker thread, one at a time;
- there, after ``json.loads`` (one call, about 15 ms per MiB), the JSON objects of the body are
  counted in Python (the loop keeps its share of the interpreter meanwhile), and a body of more
  than ``max_objects`` (``--max-request-json-objects``, default ``MAX_JSON_OBJECTS``) objects
  (messages, content parts, tool call and schema nodes) is a 400 naming both numbers, before
  pydantic sees it: what pydantic then validates in one call is bounded;
- JSON nested deeper than ``json`` decodes is a 400 that says so.

Other errors are FastAPI's own: a body that is not JSON, or JSON that fails validation, raises
``RequestValidationError`` with the same error entries (locations under ``body``), and the
server's handler turns them into the same OpenAI-style 400s. The OpenAPI document
(``/openapi.json``, ``/docs``) still describes each route's body: ``install_openapi`` adds
the schema of the model each route's dependency parses.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from pagellm.entrypoints.openai.errors import APIError

INLINE_BYTES = 64 << 10
# far above what a request needs (a chat of thousands of messages, 128 tools with their
# schemas), about 0.1 s of validation
MAX_JSON_OBJECTS = 20_000

Model = TypeVar("Model", bound=BaseModel)


def parse_body(body: bytes, model: type[Model], max_objects: int = MAX_JSON_OBJECTS) -> Model:
    """``model`` from a JSON body, or the errors FastAPI would raise for it (and the 400s of
    the module docstring)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError:
        raise HTTPException(400, "There was an error parsing the body") from None
    except RecursionError:
        raise APIError("the request body's JSON is nested too deeply to decode", 400) from None
    objects = count_objects(data)
    if objects > max_objects:
        raise APIError(f"the request body holds {objects} JSON objects, more than the limit of "
                       f"{max_objects} (--max-request-json-objects)", 400)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors()]) from None


def count_objects(data: object) -> int:
    """The JSON objects (dicts) in decoded JSON, walked in Python, without recursion."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += 1
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return count


class BodyParser:
    """Parses large bodies on one worker thread (``shutdown`` stops it)."""

    def __init__(self, max_objects: int = MAX_JSON_OBJECTS,
                 inline_bytes: int = INLINE_BYTES) -> None:
        self.max_objects = max_objects
        self.inline_bytes = inline_bytes
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-body")
        self.models: dict[Any, type[BaseModel]] = {}  # dependency -> the body it parses

    async def parse(self, raw: Request, model: type[Model]) -> Model:
        body = await raw.body()
        if len(body) <= self.inline_bytes:
            return parse_body(body, model, self.max_objects)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, parse_body, body, model, self.max_objects)

    def dependency(self, model: type[Model]) -> Model:
        """A route parameter's default: the body as ``model``."""
        async def body(raw: Request) -> Model:
            return await self.parse(raw, model)

        self.models[body] = model
        return Depends(body)

    def install_openapi(self, app: FastAPI) -> None:
        """``app.openapi`` with each route's body: the model its ``dependency`` parses, in
        the document's components."""
        def schema() -> dict[str, Any]:
            if app.openapi_schema is None:
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
                components = document.setdefault("components", {}).setdefault("schemas", {})
                for route, model in self._body_routes(app):
                    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(body.pop("$defs", {}))
                    components[model.__name__] = body
                    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                    for method in route.methods:
                        document["paths"][route.path][method.lower()]["requestBody"] = {
                            "required": True, "content": {"application/json": {"schema": ref}}}
                app.openapi_schema = document
            return app.openapi_schema

        app.openapi = schema

    def _body_routes(self, app: FastAPI) -> list[tuple[Any, type[BaseModel]]]:
        """(route, body model) of each route that takes its body from ``dependency``."""
        found = []
        for route in app.routes:
            for dependency in getattr(getattr(route, "dependant", None), "dependencies", ()):
                if dependency.call in self.models:
                    found.append((route, self.models[dependency.call]))
        return found

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
