"""Each tensor-parallel rank loads exactly its shard of every weight, from safetensors (read
lazily, a slice per rank) and from GGUF files: put back together by the split's rules
(heads, MLP rows, input columns of the row-parallel layers, vocabulary ranges) the shards
are the single-device model's weights. No process group is needed to load."""
from __future__ import annotations

import pytest
import torch
from gguf_models import write_tiny_gguf

from pagellm.distributed.parallel_state import TensorParallelGroup
from pagellm.model.layers import (MergedLinear, ParallelLMHead, QKVLinear, RowParallelLinear,
                                  VocabParallelEmbedding)
from pagellm.model.loader import load_model


def load_shards(path, world_size: int):
    full = load_model(path, pack_weights=False)[0]
    shards = [load_model(path, pack_weights=False, tp=TensorParallelGroup(rank, world_size))[0]
              for rank in range(world_size)]
    return full, shards


def reassemble(modules: list[torch.nn.Module], name: str, full: torch.Tensor) -> torch.Tensor:
    """The full parameter ``name`` rebuilt from the ranks' modules."""
    first = modules[0]
    tensors = [dict(m.named_parameters(recurse=False))[name].detach() for m in modules]
    if isinstance(first, QKVLinear):
        q = torch.cat([t[:m.shard_range("q")[1]] for t, m in zip(tensors, modules)])
        k_parts, v_parts, seen = [], [], set()
        for t, m in zip(tensors, modules):  # replicated KV heads appear on several ranks
            if m.first_kv_head in seen:
                continue
            seen.add(m.first_kv_head)
            k_off, kv_rows = m.shard_range("k")
            k_parts.append(t[k_off:k_off + kv_rows])
            v_parts.append(t[m.shard_range("v")[0]:][:kv_rows])
        return torch.cat([q, *k_parts, *v_parts])
    if isinstance(first, MergedLinear):
        parts = [torch.cat([t[slice(*_span(m, i))] for t, m in zip(tensors, modules)])
                 for i in range(len(first.output_sizes))]
        return torch.cat(parts)
    if isinstance(first, RowParallelLinear) and name == "weight":
        return torch.cat(tensors, dim=1)
    if isinstance(first, (VocabParallelEmbedding, ParallelLMHead)):
        return torch.cat([t[:m.num_rows] for t, m in zip(tensors, modules)])
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0]), name  # replicated: identical on every rank
    return tensors[0]


def _span(module: MergedLinear, index: int) -> tuple[int, int]:
    offset, size = module.shard_range(index)
    return offset, offset + size


def check_shards(full, shards, world_size: int) -> None:
    for module_name, module in full.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        ranks = [s.get_submodule(module_name) for s in shards]
        for name, param in own.items():
            torch.testing.assert_close(reassemble(ranks, name, param), param.detach(),
                                       rtol=0, atol=0, msg=f"{module_name}.{name}")
    qkv = shards[0].model.layers[0].self_attn.qkv_proj
    assert qkv.num_heads * world_size == full.config.num_attention_heads


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_safetensors_shards_rebuild_the_model(tiny_models, model):
    full, shards = load_shards(tiny_models(model), 2)
    check_shards(full, shards, 2)


def test_four_ranks_replicate_two_kv_heads(tiny_models):
    full, shards = load_shards(tiny_models("qwen2"), 4)  # 4 query heads, 2 KV heads
    assert [s.model.layers[0].self_attn.qkv_proj.first_kv_head for s in shards] == [0, 0, 1, 1]
    check_shards(full, shards, 4)


# F16: columns sliced by element; Q8_0: by 32-value blocks; Q4_K: 256-value blocks, which the
# 128-column shards of o_proj do not fill (read as whole rows, then narrowed)
@pytest.mark.parametrize("type_name", ["F16", "Q8_0", "Q4_K"])
def test_gguf_shards_rebuild_the_model(tmp_path, type_name):
    path, _ = write_tiny_gguf(tmp_path, type_name)
    full, shards = load_shards(path, 2)
    check_shards(full, shards, 2)


def test_gguf_slices_read_rows_and_block_aligned_columns(tmp_path):
    from pagellm.model.gguf_config import open_reader
    from pagellm.model.gguf_loader import dequantize, unpermute_qk
    from pagellm.model.gguf_slices import GGUFTensorSlice, _columns

    path, _ = write_tiny_gguf(tmp_path, "Q8_0")
    tensors = {t.name: t for t in open_reader(path).tensors}
    down = tensors["blk.0.ffn_down.weight"]  # [256, 512]
    lazy = GGUFTensorSlice(down, torch.float32)
    full = dequantize(down)
    assert lazy.get_shape() == [256, 512]
    assert torch.equal(lazy[10:20], full[10:20])
    assert torch.equal(lazy[:, 256:512], full[:, 256:512])
    assert torch.equal(lazy[:], full)
    # the columns' bytes only: 8 blocks of 32 values, 34 bytes each, per row
    data, narrow_after = _columns(down.data, down.tensor_type, range(256, 512))
    assert data.shape == (256, 8 * 34) and narrow_after is None
    q = tensors["blk.0.attn_q.weight"]  # 4 heads of 64 rows, reordered by llama.cpp
    lazy_q = GGUFTensorSlice(q, torch.float32, num_heads=4)
    assert torch.equal(lazy_q[128:256], unpermute_qk(dequantize(q), 4)[128:256])
