"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the API key
check.

Every way a request can fail is mapped here, so that no handler builds an error body by hand and
the official clients raise their usual exception classes (BadRequestError, AuthenticationError,
NotFoundError) with a readable message.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.core.async_engine import EngineDeadError, EngineShuttingDown
from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error",
          500: "server_error", 503: "service_unavailable"}
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


class APIError(Exception):
    """An error to send back with ``status``; ``param`` names the offending field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None,
               code: str | int | None = None) -> dict:
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=code)).model_dump(mode="json")


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def api_error_from_exception(exc: BaseException) -> APIError:
    """Map what the engine or SamplingParams raised onto an APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        message = str(exc)
        first = message.split(" ", 1)[0].split("=", 1)[0]
        return APIError(message, 400, param=first if first in _SAMPLING_FIELDS else None)
    if isinstance(exc, (EngineDeadError, EngineShuttingDown)):
        return APIError(str(exc), 503)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(f"internal server error: {type(exc).__name__}", 500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members appear in the location (e.g. "temperature.float"); keep the field path.
    field = ".".join(p for p in loc if p not in ("str", "int", "float", "bool", "list[str]",
                                                    "list[int]", "list[list[int]]")
                     and "[" not in p and not p[:1].isupper())
    if not field:
        return f"invalid request body: {first['msg']}", None
    if first.get("type") == "extra_forbidden":
        return (f"unknown field '{field}': this server does not implement it (see "
                "docs/OPENAI_API.md for the fields it accepts)", field)
    # a validator's ValueError comes prefixed "Value error, "
    message = first["msg"].removeprefix("Value error, ")
    return f"invalid value for '{field}': {message}", field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404:
            message = "not found: no such route"
        response = error_response(message, status)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = api_error_from_exception(exc)
        return error_response(err.message, err.status, err.param, err.code)


# Routes open without a key: a load balancer's health check must not need a secret,
# and the dashboard's page and script hold no data (it asks for the key, then reads
# /stats/blocks with it).
OPEN_PATHS = frozenset({"/health"})
OPEN_PREFIXES = ("/dashboard",)


class APIKeyMiddleware:
    """Demands ``Authorization: Bearer <key>``, one of ``api_keys``, on every route but
    ``OPEN_PATHS`` (pure ASGI, so that it never buffers a streaming response). The comparison
    takes constant time per key. The request's ``state.api_key_id`` names the key that matched
    (a hash, never the key), for the per-key prefix cache salt."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.expected = [(f"Bearer {key}".encode(), _key_id(key)) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS \
                or scope["path"].startswith(OPEN_PREFIXES) \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        matched = None
        for expected, key_id in self.expected:  # no early exit: time independent of which
            if hmac.compare_digest(given, expected):
                matched = key_id
        if matched is not None:
            scope.setdefault("state", {})["api_key_id"] = matched
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                   else "incorrect API key provided")
        response = error_response(message, 401, code="invalid_api_key")
        await response(scope, receive, send)


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]
