"""One attention step for the backend tests: random caches, block tables over shuffled physical
blocks, the step's q/k/v and its AttentionMetadata."""
from __future__ import annotations

import torch

from pagellm.attention import AttentionMetadata


# (tokens already in the cache, tokens computed this step), prefills first
MIXED_BATCH = [
    (0, 37),  # whole prompt: spans several 16-query blocks
    (21, 7),  # chunk continuing two earlier chunks
    (32, 9),  # prompt after a 32-token prefix-cache hit
    (0, 2),  # shortest prefill
    (24, 6),  # chunk whose first key visible under window 10 (15) ends a 16-key tile
    (0, 1),  # one-token prompt: a decode
    (24, 1),  # decode whose first key visible under window 10 (15) ends a 16-key tile
    (15, 1),  # decode whose new token ends a 16-token block
    (16, 1),  # decode at the first slot of a new block
    (70, 1),  # long decode: several key tiles
]


def make_step(batch, block_size, dtype, num_heads=6, num_kv_heads=2, head_dim=16, seed=0,
              spare_entry=False):
    """``batch``: (tokens already in the cache, tokens computed this step) per sequence,
    prefills first. ``spare_entry`` gives every block table one entry past what its sequence
    needs (tables may be longer than the context). Returns q, k, v, k_cache, v_cache,
    metadata, tables, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in batch]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 5
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n] + ([ids[-1]] if spare_entry else []))
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q for _, q in batch)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata.build([q for _, q in batch], seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, metadata, tables, seq_lens
