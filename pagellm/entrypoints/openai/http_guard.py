"""Limits on what one HTTP client may cost the server: body size, slow headers and bodies,
malformed request heads.

- ``RequestBodyGuard`` (ASGI middleware): a body over ``max_bytes`` is a 413 before it is read
  when Content-Length says so, and as soon as the limit is crossed when it is chunked; a body
  that has not fully arrived ``timeout_s`` after the request head is a 408 and the connection
  closes. Only the body is timed: once it is complete, ``receive`` waits freely (the handlers
  wait on it for the client's disconnect while a completion runs).
- ``guarded_h11_protocol`` (uvicorn's h11 protocol, subclassed): a connection whose request
  head has not fully arrived ``header_timeout_s`` after its first byte (or after it opened) is
  answered 408 and closed, which uvicorn alone never does (its keep-alive timeout runs only
  between requests); a request head h11 rejects (malformed, or over uvicorn's size limit) gets
  an OpenAI-style JSON 400 instead of uvicorn's plain text.

Each error response is written whole, with ``Connection: close``. The h11 protocol's own
errors then linger: what the client still sends is read and dropped for ``LINGER_S`` before
the socket closes, since closing with unread data would reset the connection and the client
might lose the response before reading it.
"""
from __future__ import annotations

import asyncio
import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagellm.entrypoints.openai.errors import error_body, error_response

CLOSE = {"Connection": "close"}
LINGER_S = 0.5


class RequestBodyGuard:
    """Size and time limits on request bodies (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            response = error_response(self._too_large(int(length)), 413)
            response.headers.update(CLOSE)
            await response(scope, receive, send)
            return
        await self.app(scope, self._guarded_receive(receive), send)

    def _too_large(self, size: int | str) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes"

    def _guarded_receive(self, receive: Receive) -> Receive:
        deadline = time.monotonic() + self.timeout_s
        state = {"received": 0, "complete": False}

        async def guarded() -> Message:
            if state["complete"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within "
                                         f"{self.timeout_s:g} s", headers=CLOSE) from None
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                state["complete"] = not message.get("more_body", False)
                if state["received"] > self.max_bytes:
                    raise HTTPException(413, self._too_large(f"more than {self.max_bytes}"),
                                        headers=CLOSE)
            else:
                state["complete"] = True
            return message

        return guarded


def raw_json_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body, written outside h11."""
    body = json.dumps(error_body(message, status)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


async def _service_unavailable(scope: Scope, receive: Receive, send: Send) -> None:
    """What uvicorn answers past ``limit_concurrency``, as an OpenAI-style JSON 503."""
    body = json.dumps(error_body("the server is at its connection limit "
                                 "(--limit-concurrency); try again later", 503)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def guarded_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and JSON errors (module docstring).

    uvicorn's h11 protocol answers a request past ``limit_concurrency`` with the ASGI app its
    module names ``service_unavailable`` (plain text); this server's process swaps in the JSON
    one above."""
    h11_impl.service_unavailable = _service_unavailable

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _failed = False  # an error response was written: drop input until the socket closes

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._failed:
                return
            waiting = self.cycle is None or self.cycle.response_complete
            previous = self.cycle
            super().data_received(data)
            if self.cycle is not previous:  # a request head arrived
                self._cancel_head_timer()
            elif waiting:
                self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._cancel_head_timer()
            self._write_and_close(400, "Bad Request", f"invalid HTTP request: malformed, or a "
                                  f"header block over the server's limit ({msg})")

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self._write_and_close(408, "Request Timeout", f"the request head did not arrive "
                                      f"within {header_timeout_s:g} s")

        def _write_and_close(self, status: int, reason: str, message: str) -> None:
            if self._failed or self.transport.is_closing():
                return
            self._failed = True
            self.transport.write(raw_json_response(status, reason, message))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return GuardedH11Protocol
