"""``pagellm serve MODEL``: the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import logging
import os

from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from
from pagellm.entrypoints.openai.server_config import PREFIX_CACHE_ISOLATION, ServerConfig

API_KEY_ENV = "PAGELLM_API_KEY"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models), with /health, /metrics (Prometheus), "
                    "/stats (KV cache snapshot), /tokenize and /detokenize. Stops gracefully "
                    "on SIGINT/SIGTERM.")
    p.add_argument("model", help="a local model folder or hub id")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", nargs="+", default=None,
                   help=f"demand 'Authorization: Bearer KEY' (any of the keys given) on every "
                        f"route but /health, /metrics and /stats included "
                        f"(default: ${API_KEY_ENV} when set, else no key)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in requests; the first is reported in "
                        "responses (default: MODEL)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, selected by the request's "
                        "'model' field; needs --enable-lora")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the periodic throughput / KV cache line")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats log lines (default: 10)")
    _add_limit_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def _add_limit_flags(p) -> None:
    """What one client may cost the server (see ServerConfig)."""
    defaults = ServerConfig()
    p.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                   help="larger request bodies get 413, also when sent chunked "
                        "(default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s,
                   help="seconds a client has to send a request's head (line and headers) "
                        "before 408 and close (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                   help="seconds a client has, after the head, to send the whole body before "
                        "408 and close (default: %(default)s)")
    p.add_argument("--timeout-keep-alive", type=float, default=defaults.timeout_keep_alive_s,
                   help="seconds an idle keep-alive connection stays open (default: "
                        "%(default)s)")
    p.add_argument("--limit-concurrency", type=int, default=defaults.limit_concurrency,
                   help="connections or requests in progress beyond this get 503 "
                        "(default: %(default)s)")
    p.add_argument("--prefix-cache-isolation", choices=PREFIX_CACHE_ISOLATION,
                   default="shared",
                   help="which requests may reuse each other's cached prompt prefixes: "
                        "'shared' (vLLM's default, fastest: the time to first token can tell "
                        "a client that another one sent the same prompt prefix), 'api-key' "
                        "(only requests with the same API key), 'user' (only requests with "
                        "the same 'user' field, else the same API key). Isolation costs "
                        "cache hits between tenants (default: shared)")


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """``name=path`` items of --lora-modules; ValueError naming a malformed one."""
    modules = []
    for item in values:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path:
            raise ValueError(f"--lora-modules {item!r} is invalid: expected NAME=PATH")
        modules.append((name.strip(), path))
    return tuple(modules)


def run(args: argparse.Namespace) -> int:
    from pagellm.core.async_engine import AsyncLLMEngine
    from pagellm.entrypoints.openai.api_server import run_server
    from pagellm.metrics import EngineMetrics, StatsLogger

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is invalid: must be in [0, 65535]")
    engine_args = engine_args_from(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = args.served_model_name or [args.model]
    metrics = EngineMetrics(names[0])
    stats_logger = StatsLogger(args.log_stats_interval)

    def on_step(outputs, stats) -> None:
        metrics.observe_step(outputs, stats)
        if not args.disable_log_stats:
            stats_logger.maybe_log(stats)

    engine = AsyncLLMEngine.from_engine_args(engine_args, on_step=on_step)
    api_keys = args.api_key or [k for k in [os.environ.get(API_KEY_ENV)] if k]
    config = ServerConfig(host=args.host, port=args.port, api_keys=tuple(api_keys),
                          served_model_names=tuple(names),
                          uvicorn_log_level=args.uvicorn_log_level,
                          max_request_body_bytes=args.max_request_body_bytes,
                          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                          timeout_keep_alive_s=args.timeout_keep_alive,
                          limit_concurrency=args.limit_concurrency,
                          prefix_cache_isolation=args.prefix_cache_isolation,
                          lora_modules=lora_modules)
    run_server(engine, args.model, config, metrics)
    return 0
