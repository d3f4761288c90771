"""``pagellm generate MODEL --prompt TEXT``: one generation, streamed to the terminal."""
from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from
from pagellm.sampling_params import RequestOutputKind

_request_ids = itertools.count()


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="0 for greedy decoding (default: 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default: 0)")
    g.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeat the flag for several)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after EOS")


def sampling_params_from(args: argparse.Namespace):
    from pagellm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate from one prompt, streaming the text to the terminal",
        description="Generate a continuation of --prompt (or, with --chat, an assistant reply "
                    "to it through the tokenizer's chat template) and stream it to stdout.")
    p.add_argument("model", help="a local model folder or hub id")
    p.add_argument("-p", "--prompt", required=True,
                   help="the prompt text ('-' reads stdin); -p as in llama.cpp")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message of a chat")
    p.add_argument("--system", default=None, help="system message for --chat")
    add_sampling_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args)  # bad flags fail before the slow imports
    params = sampling_params_from(args)
    from pagellm.core.engine import LLMEngine

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = LLMEngine.from_engine_args(engine_args)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt_text})
        prompt: Any = {"prompt_token_ids": chat_token_ids(engine.tokenizer, messages)}
    else:
        prompt = prompt_text
        sys.stdout.write(prompt_text)
    try:
        write_stream(stream_text(engine, prompt, params), sys.stdout)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    return 0


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def stream_text(engine, prompt: Any, params) -> Iterator[str]:
    """Yield the text of one request as it is generated (the engine's DELTA outputs: text
    that may still turn out to start a stop string is held back until it cannot). The
    request is aborted if the consumer stops early (e.g. Ctrl-C)."""
    request_id = f"cli-{next(_request_ids)}"
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request(request_id, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.error:
                    raise ValueError(output.error)
                if output.outputs[0].text:
                    yield output.outputs[0].text
    finally:
        engine.abort_request(request_id)


def write_stream(pieces: Iterator[str], out: TextIO) -> str:
    """Write each piece as it arrives; returns the whole text."""
    parts = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        parts.append(piece)
    out.write("\n")
    out.flush()
    return "".join(parts)
