"""The batched LoRA update (lora/ops.py, lora/layers.py) against its one-token-at-a-time
definition: random slots (some tokens without adapter, uneven groups, unused slots), fused
shards, ranks below the slot rank."""
from __future__ import annotations

import pytest
import torch

from pagellm.lora.adapter import LoRAPair
from pagellm.lora.layers import LoRALinear, LoRAStepState
from pagellm.lora.ops import LoRABatch, lora_reference, lora_torch
from pagellm.model.layers import Linear, QKVLinear


def random_stacks(num_slots, rows, in_features, out_features, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, rows, in_features, generator=gen).to(dtype)
    b = torch.randn(num_slots, rows, out_features, generator=gen).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("num_tokens, one_slot", [(1, False), (7, False), (64, False),
                                                  (9, True)])
def test_lora_torch_matches_reference(dtype, tol, num_tokens, one_slot):
    gen = torch.Generator().manual_seed(num_tokens)
    a, b = random_stacks(4, 24, 48, 40, dtype)
    x = torch.randn(num_tokens, 48, generator=gen).to(dtype)
    y = torch.randn(num_tokens, 40, generator=gen).to(dtype)
    slots = torch.randint(-1, 4, (num_tokens,), generator=gen)
    slots[slots == 1] = 3  # slot 1 unused: the groups are slots 0, 2 and 3
    slots[0] = 2
    if one_slot:  # one adapter and tokens without: the path without grouping
        slots[slots >= 0] = 2
    expected = lora_reference(y, x, a, b, slots)
    got = lora_torch(y.clone(), x, a, b, LoRABatch.build(slots.tolist(), 'cpu'))
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tol * scale
    untouched = slots < 0  # tokens without adapter keep the base output exactly
    assert torch.equal(got[untouched], y[untouched])


def test_fused_layer_places_each_shard(monkeypatch):
    """A q/k/v layer with pairs of ranks 2, 3 and none: each shard's columns get their own
    pair's update, scaled B included, and only the tokens of that slot do."""
    torch.manual_seed(0)
    base = QKVLinear(32, head_dim=8, num_heads=4, num_kv_heads=2)
    base.weight.data.normal_()
    state = LoRAStepState()
    layer = LoRALinear(base, max_loras=2, max_lora_rank=4, state=state)
    pairs = [LoRAPair(torch.randn(2, 32), torch.randn(32, 2)),  # q: 32 columns
             LoRAPair(torch.randn(3, 32), torch.randn(16, 3)), None]  # k: 16, v: none
    layer.set_slot(1, pairs)
    x = torch.randn(5, 32)
    slots = torch.tensor([1, -1, 1, 0, 1])
    state.batch = LoRABatch.build(slots.tolist(), 'cpu')
    got = layer(x)
    expected = base(x).double()
    for t in (0, 2, 4):
        expected[t, :32] += (x[t].double() @ pairs[0].lora_a.double().t()) @ \
            pairs[0].lora_b.double().t()
        expected[t, 32:48] += (x[t].double() @ pairs[1].lora_a.double().t()) @ \
            pairs[1].lora_b.double().t()
    assert torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-4)
    state.batch = None
    assert torch.equal(layer(x), base(x))


def test_batch_groups_tokens_by_slot():
    batch = LoRABatch.build([-1, 3, 0, 3, -1, 3], "cpu")
    assert batch.slots.tolist() == [0, 3]
    assert batch.token_index.tolist() == [[2, 0, 0], [1, 3, 5]]
    assert batch.valid.squeeze(-1).tolist() == [[True, False, False], [True, True, True]]
    assert LoRABatch.build([-1, -1], "cpu") is None
    single = LoRABatch.build([-1, 4, 4], "cpu")  # one slot: no grouping
    assert single.slot_list == [4] and single.token_index is None
    assert single.has_adapter.squeeze(-1).tolist() == [False, True, True]


def test_set_slot_rejects_a_pair_of_the_wrong_shape():
    layer = LoRALinear(Linear(16, 8), max_loras=1, max_lora_rank=4, state=LoRAStepState())
    with pytest.raises(ValueError, match="does not fit a projection of 16 -> 8"):
        layer.set_slot(0, [LoRAPair(torch.randn(2, 16), torch.randn(9, 2))])
