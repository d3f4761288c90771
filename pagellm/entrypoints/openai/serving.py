"""What completions and chat completions share: request checks, SamplingParams, waiting for
results while watching for a client disconnect, streaming deltas and server-sent events."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagellm.core.async_engine import AsyncLLMEngine, NewRequest, OutputStream
from pagellm.core.engine import check_prompt_length as engine_check_prompt_length
from pagellm.entrypoints.openai.errors import APIError, api_error_from_exception, error_body
from pagellm.entrypoints.openai.protocol import (PromptLogprobEntry, PromptTokensDetails,
                                                 SamplingRequest, UsageInfo)
from pagellm.entrypoints.openai.tokenization import TokenizerWorker
from pagellm.lora.request import LoRARequest
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("pagellm")

# JSON has no -inf; OpenAI's clients expect a number (vLLM sends the same floor).
LOGPROB_FLOOR = -9999.0


@dataclass
class ServerContext:
    """What the handlers need. ``tokenizer`` is the event loop's own copy, for small decodes
    (a logprob's token text); everything that may be large goes through ``tokenization``, on
    its own thread with its own copy (a Rust tokenizer must not be shared across threads).

    ``prefix_cache_isolation``: "shared" (vLLM's default: any request may reuse any cached
    prefix, so time to first token can reveal that someone sent the same prompt), "api-key"
    (requests reuse only prefixes cached under the same API key) or "user" (only under the
    same ``user`` field, or API key when there is none).
    """

    engine: AsyncLLMEngine
    tokenizer: Any
    tokenization: TokenizerWorker
    served_model_names: list[str]
    max_model_len: int
    prefix_cache_isolation: str = "shared"
    loras: Any = None  # LoRAModels (serving_lora.py) with --enable-lora
    # identifies the backend configuration (pagellm version, model, dtype), as OpenAI's
    system_fingerprint: str | None = None
    # chat: see serving_chat and ChatSettings
    chat: Any = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a
        name that is neither."""
        lora = None if self.loras is None else self.loras.get(name)
        if lora is None:
            self.check_model(name)
        return lora

    def response_model(self, name: str | None) -> str:
        """The ``model`` of a response: the adapter's name, else the base model's."""
        return name if self.loras is not None and self.loras.get(name) else self.model_name

    def check_model(self, name: str | None) -> None:
        # The served names are not listed: by default the first one is the local model path.
        if name is not None and name not in self.served_model_names:
            raise APIError(f"the model '{name}' does not exist: see /v1/models for the models "
                           "this server serves", 404, "model", "model_not_found")

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        return await self.tokenization.encode(text, param)

    def cache_salt(self, req: SamplingRequest, raw: Request) -> str | None:
        """The request's prefix-cache salt: its own ``cache_salt`` (vLLM's field), joined with
        the tenant's identity when the prefix cache is isolated."""
        tenant = None
        if self.prefix_cache_isolation != "shared":
            tenant = getattr(raw.state, "api_key_id", None)
            if self.prefix_cache_isolation == "user" and req.user:
                tenant = f"user:{req.user}"
            tenant = tenant or "anonymous"
        if tenant is None:
            return req.cache_salt
        return f"{tenant}\x00{req.cache_salt or ''}"


async def request_constraint(ctx: ServerContext, req: SamplingRequest,
                             reasoning: str | None = None) -> StructuredOutputsParams | None:
    """The request's structured-outputs constraint, compiled (and cached) on the tokenizer
    thread, so that a bad schema is a 400 naming the field it came from and a slow grammar
    does not stall the event loop. With a ``reasoning`` parser it constrains the answer
    after the reasoning (StructuredOutputsParams.reasoning)."""
    field, params = structured_outputs_of(req)
    if params is not None:
        if reasoning is not None:
            params = replace(params, reasoning=reasoning)
        await compile_constraint(ctx, params, field)
    return params


async def compile_constraint(ctx: ServerContext, params: StructuredOutputsParams,
                             field: str) -> None:
    compiler = getattr(getattr(ctx.engine, "engine", None), "grammar_compiler", None)
    if compiler is None:
        return
    try:
        await ctx.tokenization.run(compiler.compile, params)
    except ValueError as exc:
        raise APIError(str(exc), 400, field) from exc


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams from the request fields; a bad value is a 400 naming the field. A
    stream asks the engine for DELTA outputs, a plain response for the FINAL_ONLY one.
    ``structured``: the constraint (``request_constraint``, or a forced tool call's)."""
    if req.use_beam_search:
        raise APIError("use_beam_search is not supported: pagellm has no beam search", 400,
                       "use_beam_search")
    if req.length_penalty is not None:
        raise APIError("length_penalty applies to beam search, which pagellm does not have",
                       400, "length_penalty")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", 400,
                       "stream_options")
    if req.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
    values = dict(
        structured_outputs=structured,
        bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
        logit_bias=_logit_bias(req.logit_bias),
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    # Only the sampling values the client sent: the others stay unset, so that the engine
    # gives them the model's recommended values (generation_config.json) or its own defaults.
    values.update({name: getattr(req, name) for name in _OPTIONAL_SAMPLING_FIELDS
                   if getattr(req, name) is not None})
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise api_error_from_exception(exc) from exc


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    out = {}
    for token, bias in logit_bias.items():
        try:
            out[int(token)] = bias
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {token!r}", 400,
                           "logit_bias") from None
    return out


def structured_outputs_of(req: SamplingRequest
                          ) -> tuple[str | None, StructuredOutputsParams | None]:
    """(field, constraint) of the request: OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or one of the older ``guided_*`` fields; more than one is a 400
    naming the second."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError("response_format of type json_schema needs a json_schema object",
                           400, "response_format.json_schema")
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        found.append(("structured_outputs",
                      req.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(f"{found[1][0]} cannot be combined with {found[0][0]}: give one "
                       "constraint", 400, found[1][0])
    field, spec = found[0]
    try:
        return field, StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise APIError(str(exc), 400, field) from exc


def truncate_prompt(req: SamplingRequest, ids: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep only the last k tokens of the prompt."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k < 1:
        raise APIError(f"truncate_prompt_tokens must be at least 1, got {k}", 400,
                       "truncate_prompt_tokens")
    return ids[-k:]


def check_prompt_length(ctx: ServerContext, ids: list[int], field: str) -> None:
    """The engine's limit, checked before the engine sees the prompt so that the 400 names
    the field (OpenAI's ``context_length_exceeded``)."""
    try:
        engine_check_prompt_length(len(ids), ctx.max_model_len)
    except ValueError as exc:
        raise APIError(str(exc), 400, field, code="context_length_exceeded") from None


def prompt_logprobs_of(ctx: ServerContext, output: RequestOutput
                       ) -> list[dict[str, PromptLogprobEntry] | None] | None:
    """vLLM's response shape: one entry per prompt token (the first None), keyed by id."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): PromptLogprobEntry(
                logprob=max(lp.logprob, LOGPROB_FLOOR), rank=lp.rank,
                decoded_token=(lp.decoded_token if lp.decoded_token is not None
                               else ctx.tokenizer.decode([tid])))
             for tid, lp in entry.items()}
            for entry in output.prompt_logprobs]


_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                             "frequency_penalty", "repetition_penalty")


async def add_requests(ctx: ServerContext, requests: list[NewRequest]) -> OutputStream:
    try:
        return await ctx.engine.add_requests(requests)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to 400/503/500
        raise api_error_from_exception(exc) from exc


async def collect(ctx: ServerContext, stream: OutputStream, raw: Request
                  ) -> dict[str, RequestOutput]:
    """Wait for every request of the stream to finish; abort them if the client goes away
    first (a plain response, unlike a stream, is not cancelled by the server on disconnect)."""
    final: dict[str, RequestOutput] = {}

    async def consume() -> None:
        async for updates in stream:
            for output in updates:
                final[output.request_id] = output

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        ctx.engine.release(stream)
    if not consumer.done() or consumer.cancelled():
        raise APIError("client disconnected", 499)
    if consumer.exception() is not None:
        raise api_error_from_exception(consumer.exception())
    check_outputs(final.values())
    return final


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def check_outputs(outputs) -> None:
    """A request the engine finished with an error, or aborted because the server is shutting
    down, is not a success: 400 when the request is at fault (e.g. it can never fit in the KV
    cache), 500 when the engine is (a failed step; the server goes on serving)."""
    for output in outputs:
        if output.error:
            raise APIError(output.error, 500 if output.error_internal else 400)
        if any(c.finish_reason == "abort" for c in output.outputs):
            raise APIError("the request was aborted: the server is shutting down", 503)


def usage_of(outputs) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---------------------------------------------------------------------------- streaming
@dataclass(slots=True)
class Delta:
    """What one completion gained since the previous chunk."""

    text: str
    token_start: int  # new tokens are token_ids[token_start:]
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


@dataclass
class DeltaTracker:
    """Turns the DELTA outputs of streamed requests into chunks: which choice sends its first
    chunk (with the role, for chat), which deltas carry nothing, and the usage so far. The
    engine already holds back text that may turn out to start a stop string."""

    started: set[tuple[str, int]] = field(default_factory=set)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def delta(self, request_id: str, c: CompletionOutput) -> Delta | None:
        key = (request_id, c.index)
        first = key not in self.started
        finished = c.finish_reason is not None
        if not first and not c.text and not c.token_ids and not finished:
            return None
        self.started.add(key)
        self.completion_tokens += len(c.token_ids)
        return Delta(c.text, 0, c.finish_reason, c.stop_reason, first)

    def count_prompt(self, output: RequestOutput) -> None:
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        self.cached_tokens[output.request_id] = output.num_cached_tokens

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(self.cached_tokens.values())))


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Frame chunks as server-sent events, end with ``[DONE]``; an error after the response
    has started is sent as an error event (the status line is already gone)."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as exc:
        yield sse(error_body(exc.message, exc.status, exc.param, exc.code))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        err = api_error_from_exception(exc)
        yield sse(error_body(err.message, err.status, err.param, err.code))
    yield sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """A streaming response that always closes its body iterator when it ends, also when the
    client disconnects in mid-stream: closing runs the generator's ``finally``, which aborts the
    request and frees its KV blocks at once rather than whenever the generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
