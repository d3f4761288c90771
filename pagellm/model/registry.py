"""Architecture name (``config.architectures``) -> model class."""
from __future__ import annotations

from typing import Any

from pagellm.model.decoder import CausalLM
from pagellm.model.llama import LlamaForCausalLM, MistralForCausalLM
from pagellm.model.qwen2 import Qwen2ForCausalLM
from pagellm.model.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(hf_config: Any) -> type[CausalLM]:
    """The class for the first supported name in ``config.architectures``."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"model architecture {architectures or '(none given in config.json)'} is "
                     f"not supported; supported architectures: "
                     f"{', '.join(supported_architectures())}")
