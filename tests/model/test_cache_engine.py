"""CacheEngine: layout, bytes per block, block copies and swap round trips (all layers)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from pagellm.worker.cache_engine import CacheEngine, InFlightCopies, InFlightCopy


@pytest.fixture
def engine() -> CacheEngine:
    config = tiny_config("Qwen3ForCausalLM", num_hidden_layers=3)  # head_dim 32, 2 KV heads
    engine = CacheEngine(config, num_blocks=10, num_cpu_blocks=4, block_size=4,
                         dtype=torch.float32, device="cpu")
    for layer, (k, v) in enumerate(engine.kv_caches):  # block b of layer l holds l*100 + b
        k.copy_(layer * 100 + torch.arange(10.0).view(10, 1, 1, 1).expand_as(k))
        v.copy_(-k)
    return engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_device_cache_starts_as_zeros_and_outlives_its_engine(kv_cache_dtype):
    """On Linux the CPU cache is an anonymous mapping (pages committed as blocks fill): it
    reads as zeros everywhere before any write, every block takes its own writes, and the
    layers' views keep the memory when the engine is gone."""
    import gc

    from pagellm.attention import kv_quant

    config = tiny_config("Qwen3ForCausalLM", num_hidden_layers=2)
    # 4,096 blocks (4-8 MiB): room for whole 2 MiB pages
    engine = CacheEngine(config, num_blocks=4096, num_cpu_blocks=0, block_size=4,
                         dtype=torch.bfloat16, device="cpu",
                         kv_format=kv_quant.kv_format(kv_cache_dtype))
    cache = engine.device_cache
    assert cache.is_contiguous() and not cache.any()
    if sys.platform.startswith("linux"):
        mapping = _mapping_of(cache.data_ptr())
        assert mapping["perms"].endswith("p")  # private: a shared mapping takes no huge pages
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        if thp.is_file() and "[never]" not in thp.read_text() and "THPeligible" in mapping:
            assert mapping["THPeligible"] == "1"  # the 2 MiB-page advice holds
    assert cache.dtype == (torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8)
    views = [engine.kv_caches[1][0], engine.kv_caches[1][1]]  # layer 1's K and V
    del engine, cache
    gc.collect()
    for i, view in enumerate(views):
        view[3].fill_(i + 1)
    assert [int(v[3].sum()) for v in views] == [views[0][3].numel(), 2 * views[1][3].numel()]
    assert not views[0][:3].any() and not views[0][4:].any() and not views[1][:3].any()


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its permissions and
    its fields."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:  # "start-end perms offset dev inode path"
            start, end = (int(x, 16) for x in head[0].split("-"))
            if entry is not None:
                break
            if start <= address < end:
                entry = {"perms": head[1]}
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry is not None, hex(address)
    return entry


def test_a_cpu_cache_larger_than_the_available_ram_is_refused(tmp_path):
    """Its pages are committed as blocks fill, so a cache that cannot fit would fail mid-run:
    it is refused at start, naming the setting and the RAM available."""
    from helpers import make_tiny_model

    from pagellm import LLM
    from pagellm.worker.engine_setup import available_ram_bytes

    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    too_much = 2 * available_ram_bytes()
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={too_much}: \d+ bytes\) exceeds "
                                         r"the \d+ bytes of RAM available"):
        LLM(str(model), kv_cache_memory_bytes=too_much, max_model_len=64)


def test_the_ram_check_counts_the_ranks_on_this_host(monkeypatch):
    """Under the "mp" backend every rank's cache is on this host: their sum must fit."""
    from pagellm.config import EngineArgs
    from pagellm.worker import engine_setup

    monkeypatch.setattr(engine_setup, "available_ram_bytes", lambda: 1000)
    args = EngineArgs(model="m", kv_cache_memory_bytes=600)
    engine_setup._check_ram(args, 600)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=600: 600 bytes x 2 ranks on "
                                         r"this host\) exceeds the 1000 bytes of RAM"):
        engine_setup._check_ram(args, 600, local_ranks=2)
    with pytest.raises(ValueError, match=r"\(10% of the available RAM per rank: 1001 bytes\)"):
        engine_setup._check_ram(EngineArgs(model="m"), 1001)


def test_a_swap_space_past_70_percent_of_the_ram_is_refused(tmp_path):
    """Refused before the model loads, naming the setting and the host's RAM (vLLM's limit):
    before, it failed in torch's allocator, or took memory the host needed."""
    from helpers import make_tiny_model

    from pagellm import LLM
    from pagellm.worker.engine_setup import total_ram_bytes

    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    gib = -(-total_ram_bytes() // 2**30)
    with pytest.raises(ValueError, match=rf"swap_space={gib} GiB \(\d+ bytes\) is 1\d\d% of "
                                         r"this host's \d+ bytes of RAM; at most 70% may go"):
        LLM(str(model), swap_space=gib, max_model_len=64)


def test_the_swap_check_counts_the_ranks_and_warns_past_40_percent(monkeypatch, caplog):
    from pagellm.config import EngineArgs
    from pagellm.worker import engine_setup

    monkeypatch.setattr(engine_setup, "total_ram_bytes", lambda: 10 * 2**30)
    with caplog.at_level("WARNING", logger=engine_setup.logger.name):
        engine_setup._check_swap_space(EngineArgs(model="m", swap_space=4))  # 40%: quiet
        assert not caplog.records
        engine_setup._check_swap_space(EngineArgs(model="m", swap_space=7))  # 70%: warned
    assert "swap_space=7 GiB (7516192768 bytes) is 70% of this host's" in caplog.text
    with pytest.raises(ValueError, match=r"swap_space=4 GiB x 2 ranks on this host "
                                         r"\(8589934592 bytes\) is 80%"):
        engine_setup._check_swap_space(EngineArgs(model="m", swap_space=4), local_ranks=2)


def test_the_default_swap_space_shrinks_on_a_small_host(monkeypatch, caplog):
    """4 GiB (the default) on a 4 GiB host would be refused; a default must not refuse to
    start: it becomes 40% of the RAM (over the ranks on the host), with a warning. A value
    the user set is refused as before."""
    from pagellm.config import EngineArgs
    from pagellm.worker import engine_setup

    monkeypatch.setattr(engine_setup, "total_ram_bytes", lambda: 4 * 2**30)
    default = EngineArgs(model="m")
    with caplog.at_level("WARNING", logger=engine_setup.logger.name):
        assert engine_setup._check_swap_space(default, shrink_default=True).swap_space == 1.6
        assert engine_setup._check_swap_space(default, 2, shrink_default=True).swap_space == 0.8
    assert "the default: using swap_space=1.60 GiB (40% of the RAM)" in caplog.text
    assert default.swap_space == 4.0  # the caller's args are left alone
    with pytest.raises(ValueError, match="swap_space=3.5 GiB"):
        engine_setup._check_swap_space(EngineArgs(model="m", swap_space=3.5),
                                       shrink_default=True)
    with pytest.raises(ValueError, match="swap_space=4.0 GiB"):  # the Ray ranks' own check
        engine_setup._check_swap_space(default)


def block_values(engine: CacheEngine, block: int) -> list[float]:
    return [float(k[block].mean()) for k, _ in engine.kv_caches]


def test_layout_and_bytes_per_block(engine):
    assert len(engine.kv_caches) == 3
    for k, v in engine.kv_caches:
        assert k.shape == v.shape == (10, 4, 2, 32)
    assert engine.cpu_cache.shape[2:] == (4, 4, 2, 32)
    config = tiny_config("Qwen3ForCausalLM", num_hidden_layers=3)
    # 2 (K, V) x 3 layers x 4 tokens x 2 KV heads x 32 dims x 2 bytes
    assert CacheEngine.bytes_per_block(config, 4, torch.bfloat16) == 2 * 3 * 4 * 2 * 32 * 2


def test_bytes_per_block_counts_kv_heads_not_query_heads():
    """Llama-2-70B: 80 layers, 8 KV heads of 128 (64 query heads), fp16 -> 327,680 B/token."""
    config = tiny_config("LlamaForCausalLM", hidden_size=8192, num_attention_heads=64,
                         num_key_value_heads=8, num_hidden_layers=80)
    assert CacheEngine.bytes_per_block(config, 16, torch.float16) == 327_680 * 16


def test_copy_blocks_copies_every_layer_k_and_v(engine):
    engine.copy_blocks([(2, 7), (3, 8)])
    assert block_values(engine, 7) == [2.0, 102.0, 202.0]
    assert block_values(engine, 8) == [3.0, 103.0, 203.0]
    assert block_values(engine, 2) == [2.0, 102.0, 202.0]  # source untouched
    for k, v in engine.kv_caches:
        assert torch.equal(v, -k)


def test_swap_out_then_in_round_trips(engine):
    engine.swap_out([(5, 0), (6, 3)])
    engine.kv_caches[0][0][5].zero_()
    engine.swap_in([(0, 1), (3, 9)])  # into other device blocks
    assert block_values(engine, 1) == [5.0, 105.0, 205.0]
    assert block_values(engine, 9) == [6.0, 106.0, 206.0]
    assert float(engine.kv_caches[2][1][9].mean()) == -206.0


def test_out_of_range_block_ids_are_rejected(engine):
    with pytest.raises(ValueError, match="out of range"):
        engine.copy_blocks([(0, 10)])
    with pytest.raises(ValueError, match="out of range"):
        engine.swap_out([(0, 4)])


class FakeEvent:
    """A CUDA event's query/synchronize, completed by the test."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_in_flight_swaps_complete_in_issue_order_and_hold_their_staging():
    cpu_block = torch.zeros(2)
    first, second = FakeEvent(), FakeEvent()
    staging = [torch.full((2,), 1.0), torch.full((2,), 2.0)]
    copies = InFlightCopies()
    copies.add(InFlightCopy(first, staging[0], lambda: cpu_block.copy_(staging[0])))
    copies.add(InFlightCopy(second, staging[1], lambda: cpu_block.copy_(staging[1])))
    copies.reap()
    assert len(copies) == 2 and cpu_block.tolist() == [0.0, 0.0]  # nothing done yet
    second.done = True
    copies.reap()  # the second is done, but the first is not: neither is completed
    assert len(copies) == 2 and cpu_block.tolist() == [0.0, 0.0]
    first.done = True
    copies.reap()  # both, in order: the later swap-out to the same block wins
    assert len(copies) == 0 and cpu_block.tolist() == [2.0, 2.0]


def test_reap_with_wait_completes_every_copy():
    copies = InFlightCopies()
    events = [FakeEvent() for _ in range(3)]
    finished = []
    for i, event in enumerate(events):
        copies.add(InFlightCopy(event, torch.zeros(1), lambda i=i: finished.append(i)))
    copies.add(InFlightCopy(FakeEvent(), torch.zeros(1)))  # a swap-in: nothing to finish
    copies.reap(wait=True)
    assert finished == [0, 1, 2] and len(copies) == 0 and all(e.done for e in events)


def test_the_cpu_cache_engine_swaps_synchronously(engine):
    assert engine.swap_stream is None
    engine.swap_out([(5, 0)])
    assert len(engine.in_flight) == 0 and float(engine.cpu_cache[0, 0, 0].mean()) == 5.0
