"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

from pagellm.config import EngineArgs
from pagellm.core.engine import LLMEngine, PromptType
from pagellm.entrypoints.chat_content import flatten_content
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    ``LLM(model, **engine_args)`` takes every ``EngineArgs`` field as a keyword (``block_size``,
    ``swap_space``, ``enable_prefix_caching``, ...) and rejects unknown ones.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (they also stop when the process exits)."""
        self.llm_engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params runs with: the engine's defaults, overridden
        by the model's generation_config.json unless ``generation_config="vllm"``."""
        return SamplingParams().with_defaults(self.llm_engine.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: one
        adapter for every prompt, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority else None
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                rid = str(next(self._request_counter))
                self.llm_engine.add_request(rid, prompt, _final_only(params[i]),
                                            priority=priorities[i] if priorities else 0,
                                            lora_request=loras[i])
                ids.append(rid)
            return self._run_engine(ids, use_tqdm)
        except BaseException:
            # Ctrl-C, an exception in a callback, a failed step: none of this call's requests
            # stays in the engine holding blocks for a later call
            self.llm_engine.abort_request(ids)
            raise

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.
        ``tools`` (OpenAI's function definitions), ``continue_final_message`` and
        ``chat_template_kwargs`` go to the template, as in vLLM."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        options = dict(chat_template=chat_template, tools=tools,
                       continue_final_message=continue_final_message,
                       **(chat_template_kwargs or {}))
        prompts = [{"prompt_token_ids": list(_apply_template(
            tokenizer, conv, add_generation_prompt and not continue_final_message, **options))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                if bar is not None:
                    in_tokens += len(output.prompt_token_ids)
                    out_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, "
                                        f"output: {out_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[rid] for rid in ids]


def _final_only(params: SamplingParams | None) -> SamplingParams:
    """The offline API returns each request once, finished: its outputs are built once
    (FINAL_ONLY) instead of every step. A copy: the caller's object may be shared."""
    params = (params or SamplingParams()).clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def _apply_template(tokenizer, conversation: ChatMessages, add_generation_prompt: bool,
                    chat_template: str | None, **options) -> list[int]:
    if not conversation:
        raise ValueError("messages is empty: a chat needs at least one message")
    conversation = [{**m, "content": flatten_content(m["content"], f"messages[{i}].content")}
                    if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                    for i, m in enumerate(conversation)]
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise ValueError("the tokenizer has no chat template: pass chat_template=...")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, tokenize=True,
                                        **{k: v for k, v in options.items() if v is not None})
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a str, a dict, a list of token ids or a list of "
                        f"those, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
    return list(value)


def _progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
