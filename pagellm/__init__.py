"""pagellm: a compact LLM inference and serving engine built around a paged KV cache.

Public names are imported lazily so that ``import pagellm.kv`` (the pure-Python memory
manager) never pulls in torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "pagellm.entrypoints.llm",
    "SamplingParams": "pagellm.sampling_params",
    "RequestOutputKind": "pagellm.sampling_params",
    "EngineArgs": "pagellm.config",
    "LLMEngine": "pagellm.core.engine",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "LoRARequest": "pagellm.lora.request",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
