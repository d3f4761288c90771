"""Attention over the paged KV cache: per-step metadata, the layer, the backends."""
from pagellm.attention.layer import Attention, KVCache
from pagellm.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata

__all__ = ["Attention", "KVCache", "AttentionMetadata", "DecodeMetadata", "PrefillMetadata"]
