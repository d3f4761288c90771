"""``POST /v1/completions``: one engine request per prompt, ``n`` completions each.

Choice ``i * n + j`` is completion ``j`` of prompt ``i``, as in OpenAI's API. All prompts of a
call are added to the engine as one group (all or none), so a bad prompt in a batch rejects the
whole call with a 400 and leaves nothing running.

``echo`` with ``max_tokens=0`` returns the prompt alone (with its logprobs when ``logprobs`` is
set: how a prompt is scored), as OpenAI's legacy completions and vLLM do: the engine runs the
prompt's prefill with one token to sample, and that token is dropped from the answer.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.core.async_engine import NewRequest, OutputStream
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                 CompletionRequest, CompletionResponse,
                                                 random_id)
from pagellm.entrypoints.openai.serving import (LOGPROB_FLOOR, DeltaTracker, EventStreamResponse,
                                                ServerContext, add_requests, check_outputs,
                                                check_prompt_length, collect, prompt_logprobs_of,
                                                request_constraint, sampling_params,
                                                sse_events, truncate_prompt, usage_of)
from pagellm.outputs import LogprobsDict, RequestOutput


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request):
    lora = ctx.resolve_model(req.model)
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(f"best_of={req.best_of} is not supported: it must equal n={req.n}",
                       400, "best_of")
    if req.echo and req.logprobs is not None and req.stream:
        raise APIError("echo with logprobs is not supported when streaming", 400, "echo")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs is not supported when streaming", 400,
                       "prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens must be at least 1, got 0 (0 is allowed with echo=true, "
                       "which returns the prompt alone)", 400, "max_tokens")
    echo_only = _echo_only(req)
    prompts = [(text, truncate_prompt(req, ids)) for text, ids in await _prompts(ctx, req.prompt)]
    for i, (_, ids) in enumerate(prompts):
        check_prompt_length(ctx, ids, "prompt" if len(prompts) == 1 else f"prompt.{i}")
    if req.truncate_prompt_tokens is not None:  # echo shows the prompt the model saw
        prompts = [(await ctx.tokenization.decode(ids, "prompt"), ids) for _, ids in prompts]
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                             prompt_logprobs, await request_constraint(ctx, req))
    base_id = random_id("cmpl")
    salt = ctx.cache_salt(req, raw)
    requests = [NewRequest(f"{base_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, params,
                           req.priority, salt, lora)
                for i, (text, ids) in enumerate(prompts)]
    stream = await add_requests(ctx, requests)
    order = {r.request_id: i for i, r in enumerate(requests)}
    texts = [text for text, _ in prompts]
    if req.stream:
        chunks = _stream_chunks(ctx, req, stream, base_id, order, texts)
        return EventStreamResponse(sse_events(chunks))
    final = await collect(ctx, stream, raw)
    outputs = sorted(final.values(), key=lambda o: order[o.request_id])
    choices = [_choice(ctx, req, order[o.request_id], o, texts[order[o.request_id]])
               for o in outputs]
    choices = [c for group in choices for c in group]
    usage = usage_of(outputs)
    if echo_only:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    response = CompletionResponse(id=base_id, model=ctx.response_model(req.model), choices=choices,
                                  usage=usage,
                                  system_fingerprint=ctx.system_fingerprint)
    return JSONResponse(response.model_dump(mode="json"))


def _echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens=0``: the prompt alone, no completion."""
    return req.echo and req.max_tokens == 0


async def _prompts(ctx: ServerContext, prompt) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt; token-id prompts are decoded for ``echo``."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt must not be empty", 400, "prompt")
    tokens = ctx.tokenization
    for item in items:  # every cheap check first: a bad last prompt costs no tokenisation
        if isinstance(item, str):
            tokens.check_text(item, "prompt")
        else:
            tokens.check_token_ids(item, "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((item, await ctx.encode(item)))
        else:
            out.append((await tokens.decode(item, "prompt"), list(item)))
    return out


def _choice(ctx: ServerContext, req: CompletionRequest, prompt_index: int, output: RequestOutput,
            prompt_text: str) -> list[CompletionChoice]:
    choices = []
    echo_only = _echo_only(req)
    for c in output.outputs:
        prefix = prompt_text if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if req.echo:
                _append_logprobs(logprobs, output.prompt_token_ids,
                                 output.prompt_logprobs or [], ctx, 0)
            if not echo_only:
                _append_logprobs(logprobs, c.token_ids, c.logprobs or [], ctx, len(prefix))
        choices.append(CompletionChoice(index=prompt_index * req.n + c.index,
                                        text=prefix + ("" if echo_only else c.text),
                                        logprobs=logprobs,
                                        finish_reason="length" if echo_only else c.finish_reason,
                                        stop_reason=None if echo_only else c.stop_reason,
                                        prompt_logprobs=(prompt_logprobs_of(ctx, output)
                                                         if req.prompt_logprobs is not None
                                                         else None)))
    return choices


def _append_logprobs(out: CompletionLogprobs, token_ids: list[int],
                     logprobs: list[LogprobsDict | None], ctx: ServerContext,
                     offset: int) -> int:
    """Append OpenAI's completions logprobs for ``token_ids``, whose text starts at ``offset``
    (a None entry, the prompt's first token, has no logprob). Returns the offset after them."""
    for token, entry in zip(token_ids, logprobs):
        chosen = entry.get(token) if entry else None
        text = _token_text(ctx, token, chosen)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR) if chosen else None)
        out.top_logprobs.append({_token_text(ctx, tid, lp): max(lp.logprob, LOGPROB_FLOOR)
                                 for tid, lp in entry.items()})
    return offset


def _token_text(ctx: ServerContext, token: int, logprob) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return ctx.tokenizer.decode([token])


async def _stream_chunks(ctx: ServerContext, req: CompletionRequest, stream: OutputStream,
                         base_id: str, order: dict[str, int], texts: list[str]
                         ) -> AsyncIterator[dict]:
    """The engine's DELTA outputs as chunks."""
    created = int(time.time())
    tracker = DeltaTracker()
    echo_only = _echo_only(req)
    offsets: dict[tuple[str, int], int] = {}  # text offset of each choice's next token
    try:
        async for updates in stream:
            check_outputs(o for o in updates if o.finished)
            choices = []
            for output in updates:
                tracker.count_prompt(output)
                prompt_index = order[output.request_id]
                for c in output.outputs:
                    d = tracker.delta(output.request_id, c)
                    if d is None:
                        continue
                    text = ((texts[prompt_index] if req.echo and d.first else "")
                            + ("" if echo_only else d.text))
                    if echo_only:  # the prompt once, finished when its request is; the
                        # sampled token is not part of the answer nor of the usage
                        d.finish_reason = "length" if d.finish_reason else None
                        d.stop_reason = None
                        tracker.completion_tokens -= len(c.token_ids)
                    logprobs = None
                    if req.logprobs is not None:
                        key = (output.request_id, c.index)
                        logprobs = CompletionLogprobs()
                        offsets[key] = _append_logprobs(
                            logprobs, c.token_ids[d.token_start:],
                            (c.logprobs or [])[d.token_start:], ctx, offsets.get(key, 0))
                    choices.append(CompletionChoice(
                        index=prompt_index * req.n + c.index, text=text, logprobs=logprobs,
                        finish_reason=d.finish_reason, stop_reason=d.stop_reason))
            if choices:
                usage = tracker.usage() if _continuous_usage(req) else None
                yield CompletionResponse(id=base_id, created=created, model=ctx.response_model(req.model),
                                         choices=choices, usage=usage,
                                         system_fingerprint=ctx.system_fingerprint
                                         ).model_dump(mode="json")
        if req.stream_options and req.stream_options.include_usage:
            yield CompletionResponse(id=base_id, created=created, model=ctx.response_model(req.model),
                                     choices=[], usage=tracker.usage(),
                                     system_fingerprint=ctx.system_fingerprint
                                     ).model_dump(mode="json")
    finally:
        ctx.engine.release(stream)


def _continuous_usage(req) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: usage so far in every chunk."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)
