"""Qwen3: per-head RMSNorm on q and k (over head_dim, before rotary), explicit head_dim."""
from __future__ import annotations

from typing import Any

from pagellm.model.decoder import CausalLM, DecoderSpec


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
