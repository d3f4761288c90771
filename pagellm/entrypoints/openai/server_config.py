"""The server's settings, importable without the server (the CLI builds its flags from them)."""
from __future__ import annotations

from dataclasses import dataclass

# How the prefix cache is shared between clients (``--prefix-cache-isolation``): see
# ``ServerContext.cache_salt``.
PREFIX_CACHE_ISOLATION = ("shared", "api-key", "user")


@dataclass(slots=True)
class ServerConfig:
    """How the server listens and what one client may cost it.

    ``max_request_body_bytes``: larger bodies get 413 (far above any prompt that fits a
    context, far below what would hurt the server's memory). ``max_request_json_objects``: a
    body of more JSON objects (messages, content parts, schema nodes) gets 400 before it is
    validated (request_body.py). ``header_timeout_s`` /
    ``body_timeout_s``: a request head / body not fully arrived in that time gets 408 and the
    connection closes (slow clients cannot hold connections open). ``limit_concurrency``: more
    connections or requests in progress than this get uvicorn's 503. ``timeout_keep_alive_s``:
    idle keep-alive connections close after it. ``api_keys``: any one of them is accepted.
    ``prefix_cache_isolation``: see ``ServerContext``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    uvicorn_log_level: str = "info"
    timeout_graceful_shutdown: float = 10.0
    max_request_body_bytes: int = 16 << 20
    max_request_json_objects: int = 20_000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int = 1024
    prefix_cache_isolation: str = "shared"
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter folder), --lora-modules
    # chat (see serving_chat): a template replacing the model's (its text), whether a request
    # may send its own, tool call parsing for tool_choice="auto", the <think> splitter, and
    # whether structured outputs constrain the reasoning too (else only the answer after it)
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    structured_outputs_in_reasoning: bool = False
    allowed_origins: tuple[str, ...] = ()
    vllm_metric_names: bool = False
