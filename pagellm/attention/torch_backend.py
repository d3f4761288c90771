"""Paged attention in plain PyTorch: the CPU path, and the reference the other kernels meet.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; the K/V of token
``i`` of the step go to ``slot_mapping[i] = block * block_size + offset``.

One call handles a whole step: write the step's K/V into their slots (one ``index_copy_``), then
attend each query over its sequence's context: tokens of earlier steps (earlier prompt chunks,
prefix-cache hits) read back through the block table, and the step's own.

- Prefills (query_len > 1) run one ``scaled_dot_product_attention`` per sequence: causal over
  the step's own keys for a prompt with nothing cached, over its gathered context with a mask
  over absolute positions otherwise (see ``prefill_attention`` for why a loop).
- Decodes take a fast path. On the CPU, for float32 and bfloat16, a compiled kernel
  (attention/cpu_kernel.py) reads K/V in place; otherwise ``decode_attention`` gathers the
  context and treats the query heads sharing a KV head (grouped-query attention) as a short
  query "sequence" for that head, so no K/V is repeated per query head.

No Python loop runs over tokens, nor over decode sequences. Gathered decode contexts land in
grow-only scratch buffers reused by every layer and step: a fresh multi-megabyte tensor per
layer costs page faults that measured slower than the copy itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagellm.attention import cpu_kernel
from pagellm.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata

_scratch: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A reusable tensor of ``shape`` (uninitialised). Valid until the next call with ``name``;
    the engine runs one step at a time. Buffers made under inference mode are kept apart: such
    a tensor cannot be written in place outside it."""
    numel = math.prod(shape)
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buffer = _scratch.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(int(numel * 1.25) + 1024, dtype=dtype, device=device)
        _scratch[key] = buffer
    return buffer[:numel].view(shape)


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at ``metadata.slot_mapping``."""
    slots = metadata.slot_mapping
    if metadata.write_index is not None:  # padding tokens (slot -1) are not written
        key, value = key[metadata.write_index], value[metadata.write_index]
        slots = slots[metadata.write_index]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  name: str) -> torch.Tensor:
    """The context of each sequence: [num_seqs, num_kv_heads, max_num_blocks * block_size, D].

    A strided view over one contiguous gather (index_select copies whole blocks) into the
    scratch buffer ``name``; attention kernels accept the head stride, so no transposed copy
    is made.
    """
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = scratch(name, (num_seqs * max_blocks, block_size, num_kv_heads, head_dim),
                       cache.dtype, cache.device)
    torch.index_select(cache, 0, block_tables.flatten(), out=gathered)
    return gathered.view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, prefill: PrefillMetadata,
                      scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [num_prefill_tokens, num_heads, D]; key, value [num_prefill_tokens, KVH, D] of
    the step (already in the cache) -> output [num_prefill_tokens, num_heads, D].

    One ``scaled_dot_product_attention`` per sequence. A prompt with nothing cached attends
    causally over the step's own keys (no gather, no mask: the kernel skips the masked half,
    as transformers' does for one prompt); a chunk or a prompt after a prefix-cache hit reads
    its context back through its block table, with a mask over absolute positions. The loop
    runs over the step's prefills (a few dozen at most): one padded [prefills, longest prompt]
    grid with a dense mask measured 2.9x slower on 31 prompts of 32-512 tokens, as it computes
    the padding and cannot skip the causal half.
    """
    out = torch.empty_like(query)
    start = 0
    for i, (query_len, context_len) in enumerate(zip(prefill.query_lens, prefill.context_lens)):
        end = start + query_len
        if context_len == 0:
            k, v = key[start:end], value[start:end]  # [query_len, KVH, D]
        else:
            k = _sequence_context(k_cache, prefill, i)
            v = _sequence_context(v_cache, prefill, i)
        mask = prefill.mask(i, sliding_window)
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True)  # [1, H, query_len, D]
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def _sequence_context(cache: torch.Tensor, prefill: PrefillMetadata, index: int) -> torch.Tensor:
    """Prefill sequence ``index``'s keys or values, cached and new: [seq_len, KVH, D]."""
    seq_len = prefill.context_lens[index] + prefill.query_lens[index]
    blocks = prefill.block_tables[index, :-(-seq_len // prefill.block_size)]
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     decode: DecodeMetadata, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """query [num_decodes, num_heads, D] (one token per sequence) -> output of the same shape.

    The pure-torch decode path (what runs where the compiled kernel does not)."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    # The query heads sharing a KV head (grouped-query attention) form a short "sequence".
    grouped = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key = gather_blocks(k_cache, decode.block_tables, "decode_key")  # [S, KVH, keys, D]
    value = gather_blocks(v_cache, decode.block_tables, "decode_value")
    mask = decode.mask(sliding_window)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    if out.isnan().any():
        # The masked keys (padding entries read block 0; slots past a sequence; keys before
        # the window) weigh 0, but 0 x NaN is NaN, so a NaN in some block may have come from
        # one of them into another sequence's output: again with them zeroed, so that only
        # a NaN a sequence attends to reaches it (zeroing every step would cost ~15% of
        # this path in a batch with much padding).
        hidden = torch.nonzero(~mask.flatten())[:, 0]  # indices into [S * keys]
        for gathered in (key, value):  # [S, KVH, keys, D] over contiguous [S, keys, KVH, D]
            gathered.transpose(1, 2).view(-1, num_kv_heads * head_dim).index_fill_(0, hidden, 0)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One attention layer for a step.

    query [num_tokens, num_heads, D]; key, value [num_tokens, num_kv_heads, D] of the step's
    tokens (written to the cache here); returns [num_tokens, num_heads, D].
    """
    if metadata.prefill is None and cpu_kernel.supports(query):
        # Decodes only, through the CPU kernel: it stores the step's K/V itself, which saves
        # the two index_copy_ calls per layer (about 60 us of a layer's 1.3 ms at 64 x 512).
        return _decode(query, k_cache, v_cache, metadata.decode, scale, sliding_window,
                       new_kv=(key, value, metadata.slot_mapping))
    write_to_kv_cache(key, value, k_cache, v_cache, metadata)
    num_prefill_tokens = metadata.num_prefill_tokens
    if metadata.decode is None:
        return prefill_attention(query, key, value, k_cache, v_cache, metadata.prefill, scale,
                                 sliding_window)
    if metadata.prefill is None:
        return _decode(query, k_cache, v_cache, metadata.decode, scale, sliding_window)
    out = torch.empty_like(query)
    out[:num_prefill_tokens] = prefill_attention(
        query[:num_prefill_tokens], key[:num_prefill_tokens], value[:num_prefill_tokens],
        k_cache, v_cache, metadata.prefill, scale, sliding_window)
    out[num_prefill_tokens:] = _decode(query[num_prefill_tokens:], k_cache, v_cache,
                                       metadata.decode, scale, sliding_window)
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            decode: DecodeMetadata, scale: float, sliding_window: int | None,
            new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
    """Decode attention; ``new_kv`` (the step's K/V and slots, for the CPU kernel to store)
    only where cpu_kernel.supports(query)."""
    if cpu_kernel.supports(query):
        return cpu_kernel.paged_decode_attention(query, k_cache, v_cache, decode.block_pairs(),
                                                 decode.seq_lens, decode.max_seq_len, scale,
                                                 sliding_window, new_kv)
    return decode_attention(query, k_cache, v_cache, decode, scale, sliding_window)


def reference_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              query_lens: list[int], seq_lens: list[int],
                              block_tables: list[list[int]], scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """The definition, one sequence at a time, in float64: for a query at position p,
    softmax(q . k_j * scale) over the sequence's keys j <= p (and j > p - window), times v_j.

    Reads the cache slot by slot through the block table; the K/V of the step must already be
    in the cache. query [num_tokens, num_heads, D] packed in sequence order.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    outputs, start = [], 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        slots = torch.tensor([table[j // block_size] * block_size + j % block_size
                              for j in range(seq_len)])
        key = k_cache.flatten(0, 1)[slots].double()  # [seq_len, KVH, D]
        value = v_cache.flatten(0, 1)[slots].double()
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:start + query_len].double()  # [query_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, key) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
        start += query_len
    return torch.cat(outputs).to(query.dtype)
