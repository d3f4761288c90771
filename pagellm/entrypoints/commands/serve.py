"""``pagellm serve MODEL``: the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import logging
import os

from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from
from pagellm.entrypoints.openai.server_config import PREFIX_CACHE_ISOLATION, ServerConfig

API_KEY_ENV = "PAGELLM_API_KEY"
# vLLM's variable, honoured when PAGELLM_API_KEY is unset: a deployment that sets only it must
# not run without authentication
VLLM_API_KEY_ENV = "VLLM_API_KEY"


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
                        f"(default: ${API_KEY_ENV} when set, else ${VLLM_API_KEY_ENV}, else "
                        f"no key)")
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
    _add_chat_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def _add_limit_flags(p) -> None:
    """What one client may cost the server (see ServerConfig)."""
    defaults = ServerConfig()
    p.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                   help="larger request bodies get 413, also when sent chunked "
                        "(default: %(default)s)")
    p.add_argument("--max-request-json-objects", type=int,
                   default=defaults.max_request_json_objects,
                   help="request bodies with more JSON objects (messages, content parts, schema "
                        "nodes) get 400 before they are validated, which would hold the event "
                        "loop (default: %(default)s)")
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


def _add_chat_flags(p) -> None:
    from pagellm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
    from pagellm.structured_outputs import REASONING_PARSERS

    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file used instead of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template (a Jinja program run by "
                        "the server; refused with 400 otherwise)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto': the answer is parsed for tool calls with "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are written in the model's answers")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="move an answer's reasoning into message.reasoning_content: "
                        "'think': a leading <think>...</think>; 'deepseek_r1': everything "
                        "up to </think> (the template opened <think>). Structured outputs "
                        "and forced tool calls then constrain only the answer after the "
                        "reasoning")
    p.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with --reasoning-parser: constrain structured outputs and forced tool "
                        "calls from the first token, the reasoning included (vLLM's "
                        "structured_outputs_config.enable_in_reasoning)")
    p.add_argument("--allowed-origins", nargs="+", default=None,
                   help="origins allowed by CORS (e.g. http://localhost:3000, or *); "
                        "default: no CORS headers")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility: pagellm never runs a model's own "
                        "code (its architectures are built in)")
    p.add_argument("--vllm-metric-names", action="store_true",
                   help="also export the metrics under vLLM's names (vllm:*, label engine) so "
                        "that existing dashboards work")


def _chat_options(args: argparse.Namespace) -> dict:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.structured_outputs_in_reasoning and args.reasoning_parser is None:
        raise ValueError("--structured-outputs-in-reasoning needs --reasoning-parser")
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as exc:
            raise ValueError(f"--chat-template {args.chat_template!r} cannot be read: "
                             f"{exc.strerror}") from None
    return dict(chat_template=template,
                trust_request_chat_template=args.trust_request_chat_template,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
                allowed_origins=tuple(args.allowed_origins or ()))


def run(args: argparse.Namespace) -> int:
    from pagellm.core.async_engine import AsyncLLMEngine
    from pagellm.entrypoints.openai.api_server import run_server
    from pagellm.metrics import EngineMetrics, StatsLogger

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is invalid: must be in [0, 65535]")
    chat_options = _chat_options(args)
    if args.trust_remote_code:
        logging.getLogger("pagellm").info("--trust-remote-code has no effect: pagellm never "
                                          "runs a model's own code")
    engine_args = engine_args_from(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = args.served_model_name or [args.model]
    metrics = EngineMetrics(names[0], vllm_names=args.vllm_metric_names)
    stats_logger = StatsLogger(args.log_stats_interval)

    def on_step(outputs, stats) -> None:
        metrics.observe_step(outputs, stats)
        if not args.disable_log_stats:
            stats_logger.maybe_log(stats)

    engine = AsyncLLMEngine.from_engine_args(engine_args, on_step=on_step)
    api_keys = args.api_key or [k for k in [os.environ.get(API_KEY_ENV)
                                            or os.environ.get(VLLM_API_KEY_ENV)] if k]
    config = ServerConfig(host=args.host, port=args.port, api_keys=tuple(api_keys),
                          served_model_names=tuple(names),
                          uvicorn_log_level=args.uvicorn_log_level,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_request_json_objects=args.max_request_json_objects,
                          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                          timeout_keep_alive_s=args.timeout_keep_alive,
                          limit_concurrency=args.limit_concurrency,
                          prefix_cache_isolation=args.prefix_cache_isolation,
                          lora_modules=lora_modules,
                          vllm_metric_names=args.vllm_metric_names, **chat_options)
    run_server(engine, args.model, config, metrics)
    return 0
