"""Qwen2 / Qwen2.5: Llama's layers with a bias on q, k and v (not on o_proj)."""
from __future__ import annotations

from typing import Any

from pagellm.model.decoder import CausalLM, DecoderSpec


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
