"""``pagellm chat MODEL``: an interactive chat in the terminal, against the engine in-process.

Each turn sends the whole conversation through the tokenizer's chat template; with prefix
caching on (the default) the earlier turns' KV blocks are reused rather than recomputed.
"""
from __future__ import annotations

import argparse
import sys

from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from
from pagellm.entrypoints.commands.generate import (add_sampling_flags, chat_token_ids,
                                                   sampling_params_from, stream_text,
                                                   write_stream)

HELP_TEXT = "Commands: /reset clears the conversation, /exit (or Ctrl-D) quits."


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", help="chat with a model in the terminal",
        description="An interactive chat with MODEL, streamed to the terminal. " + HELP_TEXT)
    p.add_argument("model", help="a local model folder or hub id")
    p.add_argument("--system", default=None, help="system message at the start of the chat")
    add_sampling_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args)  # bad flags fail before the slow imports
    params = sampling_params_from(args)
    from pagellm.core.engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP_TEXT)
    messages = _fresh(args.system)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            messages = _fresh(args.system)
            continue
        messages.append({"role": "user", "content": line})
        reply = _turn(engine, messages, params)
        if reply is None:
            messages.pop()  # interrupted: forget the unanswered message
        else:
            messages.append({"role": "assistant", "content": reply})


def _fresh(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _turn(engine, messages: list[dict[str, str]], params) -> str | None:
    """Stream one reply; None when Ctrl-C cut it short, or when the chat outgrew the context."""
    try:
        ids = chat_token_ids(engine.tokenizer, messages)
        return write_stream(stream_text(engine, {"prompt_token_ids": ids}, params), sys.stdout)
    except KeyboardInterrupt:
        print("\n[interrupted]")
        return None
    except ValueError as exc:
        print(f"[error: {exc}; /reset starts a new chat]", file=sys.stderr)
        return None
