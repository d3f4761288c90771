"""Llama 2 / Llama 3 (rope scaling "llama3" and "linear") and Mistral (sliding window)."""
from __future__ import annotations

from typing import Any

from pagellm.model.decoder import CausalLM, DecoderSpec


class LlamaForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=attention_bias, o_proj_bias=attention_bias,
                           mlp_bias=bool(getattr(config, "mlp_bias", False)))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; the sliding window comes from ``config.sliding_window``."""
