"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, then one
engine request with ``n`` completions.

Only the model's own chat template is used: a template sent by a client would be a Jinja program
run inside the server.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagellm.core.async_engine import NewRequest, OutputStream
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                 ChatCompletionRequest, ChatCompletionResponse,
                                                 ChatLogprobs, ChatLogprobToken, ChatMessage,
                                                 ChatResponseMessage, ChatStreamChoice,
                                                 DeltaMessage, TopLogprob, random_id)
from pagellm.entrypoints.openai.serving import (LOGPROB_FLOOR, DeltaTracker, EventStreamResponse,
                                                ServerContext, add_requests, check_outputs,
                                                collect, sampling_params, sse_events, usage_of)
from pagellm.outputs import CompletionOutput, LogprobsDict


async def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage],
                          add_generation_prompt: bool = True) -> list[int]:
    if not messages:
        raise APIError("messages must not be empty: a chat needs at least one message", 400,
                       "messages")
    if not ctx.tokenization.has_chat_template():
        raise APIError("the model's tokenizer has no chat template: use /v1/completions", 400)
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return await ctx.tokenization.apply_chat_template(conversation, add_generation_prompt)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - templates raise what they like on odd input
        raise APIError(f"the chat template rejected the messages: {exc}", 400,
                       "messages") from exc


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    lora = ctx.resolve_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
    ids = await chat_prompt_ids(ctx, req.messages, req.add_generation_prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs)
    request_id = random_id("chatcmpl")
    stream = await add_requests(ctx, [NewRequest(request_id, {"prompt_token_ids": ids}, params,
                                                 req.priority, ctx.cache_salt(req, raw),
                                                 lora)])
    if req.stream:
        chunks = _stream_chunks(ctx, req, stream, request_id)
        return EventStreamResponse(sse_events(chunks))
    output = (await collect(ctx, stream, raw))[request_id]
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                          logprobs=_logprobs(c.token_ids, c.logprobs, req, ctx),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in output.outputs]
    response = ChatCompletionResponse(id=request_id, model=ctx.response_model(req.model),
                                      choices=choices, usage=usage_of([output]))
    return JSONResponse(response.model_dump(mode="json"))


def _logprobs(token_ids: list[int], logprobs: list[LogprobsDict] | None,
              req: ChatCompletionRequest, ctx: ServerContext) -> ChatLogprobs | None:
    if not req.logprobs or logprobs is None:
        return None
    k = req.top_logprobs or 0
    content = []
    for token, entry in zip(token_ids, logprobs):
        chosen = entry[token]
        text = _text(ctx, token, chosen)
        top = sorted(entry.items(), key=lambda item: item[1].rank or 0)[:k]
        content.append(ChatLogprobToken(
            token=text, logprob=max(chosen.logprob, LOGPROB_FLOOR), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=_text(ctx, tid, lp),
                                     logprob=max(lp.logprob, LOGPROB_FLOOR),
                                     bytes=list(_text(ctx, tid, lp).encode()))
                          for tid, lp in top]))
    return ChatLogprobs(content=content)


def _text(ctx: ServerContext, token: int, logprob) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return ctx.tokenizer.decode([token])


async def _stream_chunks(ctx: ServerContext, req: ChatCompletionRequest, stream: OutputStream,
                         request_id: str) -> AsyncIterator[dict]:
    """The engine's DELTA outputs as chunks."""
    created = int(time.time())
    tracker = DeltaTracker()
    try:
        async for updates in stream:
            check_outputs(o for o in updates if o.finished)
            for output in updates:
                tracker.count_prompt(output)
                choices = [choice for c in output.outputs
                           for choice in _stream_choices(ctx, req, tracker, request_id, c)]
                if choices:
                    yield ChatCompletionChunk(id=request_id, created=created,
                                              model=ctx.response_model(req.model),
                                              choices=choices).model_dump(mode="json")
        if req.stream_options and req.stream_options.include_usage and tracker.prompt_tokens:
            yield ChatCompletionChunk(id=request_id, created=created,
                                      model=ctx.response_model(req.model),
                                      choices=[], usage=tracker.usage()).model_dump(mode="json")
    finally:
        ctx.engine.release(stream)


def _stream_choices(ctx: ServerContext, req: ChatCompletionRequest, tracker: DeltaTracker,
                    request_id: str, c: CompletionOutput) -> list[ChatStreamChoice]:
    """A choice's first chunk also carries the role, as OpenAI's does."""
    d = tracker.delta(request_id, c)
    if d is None:
        return []
    logprobs = None
    if c.logprobs is not None:
        logprobs = _logprobs(c.token_ids[d.token_start:], c.logprobs[d.token_start:], req, ctx)
    delta = DeltaMessage(role="assistant" if d.first else None, content=d.text)
    return [ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                             finish_reason=d.finish_reason, stop_reason=d.stop_reason)]
