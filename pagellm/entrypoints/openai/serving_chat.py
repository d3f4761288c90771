"""``POST /v1/chat/completions``: messages through the chat template, then one engine request
with ``n`` completions; tool calls and reasoning split out of the answer (tool_calls.py).

The template is the model's, or the server's ``--chat-template``. A template sent by a client
(``chat_template``) is a Jinja program run inside the server, so it is refused unless the
server was started with ``--trust-request-chat-template`` (as vLLM). Tools go to the template
(``tools=``); a template that does not mention them gets them in a system message instead, in
the Hermes format, so that a model is never asked to call tools it was not shown.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

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
                                                check_prompt_length, collect, compile_constraint,
                                                prompt_logprobs_of, request_constraint,
                                                sampling_params,
                                                sse_events, truncate_prompt, usage_of)
from pagellm.entrypoints.openai.tool_calls import (ReasoningStreamer, ToolCallStreamer,
                                                   extract_calls, forced_call_grammar,
                                                   split_reasoning, strict_call_grammar)
from pagellm.outputs import CompletionOutput, LogprobsDict
from pagellm.structured_outputs import StructuredOutputsParams

# apply_chat_template's own arguments: chat_template_kwargs must not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(slots=True)
class ToolMode:
    """How this request's answer is read: ``mode`` None (plain text), a parser name,
    ``required`` or ``named:<function>`` (see tool_calls.extract_calls)."""

    mode: str | None = None
    forced: bool = False


def _message_dict(m: ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.text() if m.content is not None or not
                 m.tool_calls else None}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        # templates read the arguments as a mapping (``arguments | tojson``)
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _calls_as_text(message: dict) -> dict:
    """For a template that ignores ``tool_calls``: the calls written into the content, in the
    Hermes format the tools system prompt asks for."""
    calls = message.pop("tool_calls", None)
    if not calls:
        return message
    text = "".join("<tool_call>\n" + json.dumps(
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        ensure_ascii=False) + "\n</tool_call>" for c in calls)
    message["content"] = (message.get("content") or "") + text
    return message


def _tools_system_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer. The functions:\n<tools>\n"
            f"{listing}\n</tools>\nTo call a function, answer with a JSON object of its name "
            "and arguments inside tags: <tool_call>\n{\"name\": <function-name>, "
            "\"arguments\": <args-json-object>}\n</tool_call>")


async def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage],
                          add_generation_prompt: bool = True,
                          req: ChatCompletionRequest | None = None) -> list[int]:
    if not messages:
        raise APIError("messages must not be empty: a chat needs at least one message", 400,
                       "messages")
    settings = ctx.chat
    template = settings.chat_template if settings is not None else None
    if req is not None and req.chat_template is not None:
        if settings is None or not settings.trust_request_chat_template:
            raise APIError("chat_template is refused: a template is code run by the server; "
                           "start it with --trust-request-chat-template to allow it", 400,
                           "chat_template")
        template = req.chat_template
    if template is None and not ctx.tokenization.has_chat_template():
        raise APIError("the model's tokenizer has no chat template: use /v1/completions", 400)
    conversation = [_message_dict(m) for m in messages]
    source = template if template is not None else ctx.tokenization.template_source()
    if "tool_calls" not in source:
        conversation = [_calls_as_text(m) for m in conversation]
    options: dict = {"chat_template": template}
    if req is not None:
        options.update(_template_options(ctx, req, conversation, template))
        if req.continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # vLLM: the final message is continued, not closed
    try:
        return await ctx.tokenization.apply_chat_template(conversation, add_generation_prompt,
                                                          **options)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - templates raise what they like on odd input
        raise APIError(f"the chat template rejected the messages: {exc}", 400,
                       "messages") from exc


def _template_options(ctx: ServerContext, req: ChatCompletionRequest, conversation: list[dict],
                      template: str | None) -> dict:
    options: dict = {}
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(f"chat_template_kwargs must not set {reserved[0]!r}: it is an argument "
                       "of the template call itself", 400, "chat_template_kwargs")
    options.update(kwargs)
    if req.continue_final_message:
        if conversation[-1]["role"] != "assistant":
            raise APIError("continue_final_message needs an assistant message last", 400,
                           "continue_final_message")
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise APIError("continue_final_message and add_generation_prompt cannot both be "
                           "true", 400, "continue_final_message")
        options["continue_final_message"] = True
    if req.tools and req.tool_choice != "none":
        tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools]
        source = template if template is not None else ctx.tokenization.template_source()
        if "tools" in source:
            options["tools"] = tools
        else:
            conversation.insert(0, {"role": "system", "content": _tools_system_prompt(tools)})
    return options


def _tool_mode(ctx: ServerContext, req: ChatCompletionRequest) -> ToolMode:
    choice = req.tool_choice
    if req.functions is not None or req.function_call is not None:
        field = "functions" if req.functions is not None else "function_call"
        raise APIError(f"{field} is OpenAI's deprecated form of tools: send tools and "
                       "tool_choice", 400, field)
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", 400, "tool_choice")
        return ToolMode()
    if choice == "none":
        return ToolMode()
    if choice == "required":
        return ToolMode("required", forced=True)
    if choice not in (None, "auto"):
        name = choice.function.name
        if name not in {t.function.name for t in req.tools}:
            raise APIError(f"tool_choice names the function {name!r}, which is not in tools",
                           400, "tool_choice")
        return ToolMode(f"named:{name}", forced=True)
    settings = ctx.chat
    if settings is None or not settings.enable_auto_tool_choice:
        raise APIError("tool_choice 'auto' needs a server started with "
                       "--enable-auto-tool-choice and --tool-call-parser (or send "
                       "tool_choice 'required', 'none' or a named function)", 400,
                       "tool_choice")
    return ToolMode(settings.tool_call_parser)


def _check_refused(req: ChatCompletionRequest) -> None:
    if req.reasoning_effort is not None:
        raise APIError("reasoning_effort is not supported: pass the model's own switch in "
                       "chat_template_kwargs (e.g. {\"enable_thinking\": false})", 400,
                       "reasoning_effort")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs is not supported when streaming", 400,
                       "prompt_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    lora = ctx.resolve_model(req.model)
    _check_refused(req)
    tools = _tool_mode(ctx, req)
    ids = truncate_prompt(req, await chat_prompt_ids(ctx, req.messages,
                                                     req.add_generation_prompt, req))
    check_prompt_length(ctx, ids, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # with a reasoning parser, the answer after the reasoning is constrained (as in vLLM)
    after = _constrained_after(ctx)
    structured = await request_constraint(ctx, req, after)
    if tools.forced:
        if structured is not None:
            raise APIError("a forced tool call cannot be combined with response_format, "
                           "structured_outputs or guided_*", 400, "tool_choice")
        named = tools.mode[6:] if tools.mode.startswith("named:") else None
        structured = replace(forced_call_grammar(req.tools, named, req.parallel_tool_calls),
                             reasoning=after)
        await compile_constraint(ctx, structured, "tools")
    elif tools.mode is not None:  # auto: constrained only when a function asks for strict
        strict = await _strict_calls(ctx, req, tools.mode, after)
        if strict is not None:
            if structured is not None:
                raise APIError("tools with strict: true cannot be combined with "
                               "response_format, structured_outputs or guided_*", 400, "tools")
            structured = strict
    params = sampling_params(req, max_tokens, logprobs, structured=structured)
    request_id = random_id("chatcmpl")
    stream = await add_requests(ctx, [NewRequest(request_id, {"prompt_token_ids": ids}, params,
                                                 req.priority, ctx.cache_salt(req, raw),
                                                 lora)])
    if req.stream:
        chunks = _stream_chunks(ctx, req, stream, request_id, tools)
        return EventStreamResponse(sse_events(chunks))
    output = (await collect(ctx, stream, raw))[request_id]
    choices = []
    for c in output.outputs:
        message = _message(ctx, c, tools)
        choices.append(ChatChoice(index=c.index, message=message,
                                  logprobs=_logprobs(c.token_ids, c.logprobs, req, ctx),
                                  finish_reason=_finish_reason(c.finish_reason, tools, message),
                                  stop_reason=c.stop_reason))
    response = ChatCompletionResponse(
        id=request_id, model=ctx.response_model(req.model), choices=choices, usage=usage_of([output]),
        system_fingerprint=ctx.system_fingerprint,
        prompt_logprobs=prompt_logprobs_of(ctx, output) if req.prompt_logprobs is not None
        else None)
    return JSONResponse(response.model_dump(mode="json"))


def _constrained_after(ctx: ServerContext) -> str | None:
    """The reasoning parser whose reasoning precedes the constrained answer, or None when
    constraints apply from the first token (no parser, or --structured-outputs-in-reasoning)."""
    chat = ctx.chat
    if chat is None or chat.structured_outputs_in_reasoning:
        return None
    return chat.reasoning_parser


async def _strict_calls(ctx: ServerContext, req: ChatCompletionRequest, parser: str,
                        reasoning: str | None) -> StructuredOutputsParams | None:
    """The compiled grammar of strict tool calls in auto mode (None when no function is
    strict). A strict function whose schema cannot be enforced is a 400 naming it."""
    grammar = strict_call_grammar(req.tools, parser, req.parallel_tool_calls, reasoning)
    if grammar is None:
        return None
    try:
        await compile_constraint(ctx, grammar, "tools")
    except APIError:
        # name the function at fault: compile the strict schemas one by one
        for i, tool in enumerate(req.tools):
            fn = tool.function
            if not fn.strict or not fn.parameters:
                continue
            field = f"tools.{i}.function.parameters"
            try:
                await compile_constraint(ctx, StructuredOutputsParams(json=fn.parameters),
                                         field)
            except (APIError, ValueError) as exc:
                raise APIError(f"function {fn.name!r} has strict: true, but its parameters "
                               f"schema cannot be enforced: {exc}", 400, field) from exc
        raise
    return grammar


def _message(ctx: ServerContext, c: CompletionOutput, tools: ToolMode) -> ChatResponseMessage:
    reasoning, text = None, c.text
    if ctx.chat is not None and ctx.chat.reasoning_parser:
        reasoning, text = split_reasoning(text, ctx.chat.reasoning_parser)
    if tools.mode is None or c.finish_reason == "length":
        return ChatResponseMessage(content=text, reasoning_content=reasoning)
    content, calls = extract_calls(text, tools.mode)
    return ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)


def _finish_reason(reason: str | None, tools: ToolMode, message: ChatResponseMessage
                   ) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call; a named tool_choice ends "stop"."""
    if reason == "stop" and message.tool_calls and not tools.mode.startswith("named:"):
        return "tool_calls"
    return reason


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
                         request_id: str, tools: ToolMode) -> AsyncIterator[dict]:
    """The engine's DELTA outputs as chunks."""
    created = int(time.time())
    tracker = DeltaTracker()
    splitters: dict[int, _ChoiceSplitter] = {}
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    try:
        async for updates in stream:
            check_outputs(o for o in updates if o.finished)
            for output in updates:
                tracker.count_prompt(output)
                choices = [choice for c in output.outputs
                           for choice in _stream_choices(ctx, req, tracker, request_id, c,
                                                         splitters, tools)]
                if choices:
                    yield ChatCompletionChunk(
                        id=request_id, created=created, model=ctx.response_model(req.model), choices=choices,
                        usage=tracker.usage() if continuous else None,
                        system_fingerprint=ctx.system_fingerprint).model_dump(mode="json")
        if req.stream_options and req.stream_options.include_usage and tracker.prompt_tokens:
            yield ChatCompletionChunk(id=request_id, created=created, model=ctx.response_model(req.model),
                                      choices=[], usage=tracker.usage(),
                                      system_fingerprint=ctx.system_fingerprint
                                      ).model_dump(mode="json")
    finally:
        ctx.engine.release(stream)


@dataclass
class _ChoiceSplitter:
    """One streamed choice's text split into reasoning, content and tool-call pieces."""

    reasoning: ReasoningStreamer | None
    tools: ToolCallStreamer | None

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, finished)
        calls = None
        if self.tools is not None:
            text, calls = self.tools.feed(text, finished)
        return DeltaMessage(content=text or None, reasoning_content=reasoning,
                            tool_calls=calls or None)


def _stream_choices(ctx: ServerContext, req: ChatCompletionRequest, tracker: DeltaTracker,
                    request_id: str, c: CompletionOutput, splitters: dict[int, _ChoiceSplitter],
                    tools: ToolMode) -> list[ChatStreamChoice]:
    """A choice's first chunk also carries the role, as OpenAI's does."""
    d = tracker.delta(request_id, c)
    if d is None:
        return []
    splitter = splitters.get(c.index)
    if splitter is None:
        reasoning = (ReasoningStreamer(ctx.chat.reasoning_parser)
                     if ctx.chat is not None and ctx.chat.reasoning_parser else None)
        splitter = splitters[c.index] = _ChoiceSplitter(
            reasoning, ToolCallStreamer(tools.mode) if tools.mode else None)
    delta = splitter.feed(d.text, d.finish_reason is not None)
    delta.role = "assistant" if d.first else None
    logprobs = None
    if c.logprobs is not None:
        logprobs = _logprobs(c.token_ids[d.token_start:], c.logprobs[d.token_start:], req, ctx)
    finish = d.finish_reason
    if finish == "stop" and splitter.tools is not None and splitter.tools.has_calls \
            and not tools.mode.startswith("named:"):
        finish = "tool_calls"
    if not d.first and finish is None and delta.content is None and \
            delta.reasoning_content is None and not delta.tool_calls and logprobs is None:
        return []
    return [ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                             finish_reason=finish, stop_reason=d.stop_reason)]
