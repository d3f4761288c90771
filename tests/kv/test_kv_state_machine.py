"""Random sequences of operations on a small pool, checking the invariants after every step.

The machine plays scheduler and model side at once: it admits prompts (with prefix lookups and
chunked prefill), appends tokens, forks, frees, swaps out and in, and keeps a ShadowKV of what the
KV tensors would hold. After every step: the manager's own invariant check (every block free or
held, never both; ref count = tables holding it; free + used = total); every sequence reads back
its own tokens through its block table; every cached block holds the tokens of its hash; every
prefix match points at blocks holding the prompt. At the end, freeing everything frees every block.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_shadow import ShadowKV

from pagellm.kv import ContiguousKVCacheManager, KVCacheManager, PrefixMatch

# Prompts share stems so that prefix lookups hit, at every block size.
STEMS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 0, 0, 0, 1, 1], [3, 3, 3, 3, 3, 3, 3]]
EXTRA_KEYS = [(), ("lora-a",)]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | ContiguousKVCacheManager | None = None
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @initialize(paged=st.booleans(), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(2, 16), num_cpu_blocks=st.integers(0, 10),
                caching=st.booleans(), max_model_len=st.integers(4, 16))
    def setup(self, paged, block_size, num_blocks, num_cpu_blocks, caching, max_model_len):
        if paged:
            self.mgr = KVCacheManager(num_blocks, block_size, num_cpu_blocks,
                                      enable_prefix_caching=caching, watermark=0.2)
            self.max_len = 10**9
        else:
            max_model_len = min(max_model_len, num_blocks * block_size)
            self.mgr = ContiguousKVCacheManager(num_blocks, block_size, max_model_len,
                                                num_cpu_blocks, watermark=0.2)
            self.max_len = max_model_len
        self.shadow = ShadowKV(num_blocks, num_cpu_blocks, block_size)

    # ---- helpers ------------------------------------------------------------------------------

    def device_ids(self) -> list[int]:
        return [s for s in self.tokens if not self.mgr.is_swapped(s)]

    def swapped_ids(self) -> list[int]:
        return [s for s in self.tokens if self.mgr.is_swapped(s)]

    def snapshot(self) -> tuple:
        tables = {s: (self.mgr.num_tokens(s), self.mgr.is_swapped(s),
                      None if self.mgr.is_swapped(s) else self.mgr.get_block_table(s))
                  for s in self.tokens}
        return self.mgr.get_stats().as_dict(), tables

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def check_prefix(self, match: PrefixMatch, prompt: list[int]) -> None:
        bs = self.mgr.block_size
        assert match.num_tokens == len(match.block_ids) * bs <= max(len(prompt) - 1, 0)
        for i, block_id in enumerate(match.block_ids):
            assert self.shadow.holds(block_id, prompt[i * bs:(i + 1) * bs]), \
                f"prefix block {block_id} does not hold the prompt's tokens"

    def grow(self, seq_id: int, num_new: int) -> None:
        """allocate_slots, then play the model side; on failure nothing may have changed."""
        before = self.snapshot()
        start = self.mgr.num_tokens(seq_id)
        copies = self.mgr.allocate_slots(seq_id, self.tokens[seq_id], num_new)
        if copies is None:
            assert self.snapshot() == before
            return
        self.shadow.copy_blocks(copies)
        self.shadow.write(self.mgr.get_block_table(seq_id), self.tokens[seq_id],
                          start, start + num_new)

    # ---- rules --------------------------------------------------------------------------------

    @precondition(lambda self: self.mgr is not None)
    @rule(data=st.data())
    def admit(self, data):
        stem = data.draw(st.sampled_from(STEMS))
        prompt = stem[:data.draw(st.integers(0, len(stem)))]
        prompt = (prompt + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5)))
        prompt = prompt[:self.max_len]
        extra_keys = data.draw(st.sampled_from(EXTRA_KEYS))
        stats_before = self.mgr.get_stats().as_dict()
        match = self.mgr.lookup_prefix(prompt, extra_keys)
        assert self.mgr.get_stats().as_dict() == stats_before, "lookup_prefix had side effects"
        self.check_prefix(match, prompt)
        num_new = data.draw(st.integers(1, len(prompt) - match.num_tokens))
        seq_id = self.new_id()
        before = self.snapshot()
        copies = self.mgr.allocate_slots(seq_id, prompt, num_new, prefix=match,
                                         extra_keys=extra_keys, watermark=data.draw(st.booleans()))
        if copies is None:
            assert self.snapshot() == before
            return
        assert self.mgr.num_tokens(seq_id) == match.num_tokens + num_new
        self.tokens[seq_id] = prompt
        self.shadow.copy_blocks(copies)
        self.shadow.write(self.mgr.get_block_table(seq_id), prompt, match.num_tokens,
                          match.num_tokens + num_new)

    @precondition(lambda self: self.mgr is not None and self.device_ids())
    @rule(data=st.data())
    def step(self, data):
        """Continue a chunked prefill, or decode 1-3 new tokens."""
        seq_id = data.draw(st.sampled_from(self.device_ids()))
        num_tokens, tokens = self.mgr.num_tokens(seq_id), self.tokens[seq_id]
        if num_tokens < len(tokens):
            num_new = data.draw(st.integers(1, len(tokens) - num_tokens))
        else:
            num_new = min(data.draw(st.integers(1, 3)), self.max_len - num_tokens)
            if num_new == 0:
                return
            self.tokens[seq_id] = tokens + data.draw(
                st.lists(st.integers(0, 3), min_size=num_new, max_size=num_new))
        self.grow(seq_id, num_new)

    @precondition(lambda self: self.mgr is not None and self.device_ids())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.device_ids()))
        child = self.new_id()
        copies = self.mgr.fork(parent, child)
        if copies is None:  # the contiguous manager may lack a free run
            return
        self.shadow.copy_blocks(copies)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.mgr is not None and self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.mgr is not None and self.device_ids())
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.device_ids()), min_size=1, unique=True))
        before = self.snapshot()
        pairs = self.mgr.swap_out(ids)
        if pairs is None:
            assert self.snapshot() == before
            return
        assert len({d for d, _ in pairs}) == len({c for _, c in pairs}) == len(pairs)
        self.shadow.swap_out(pairs)
        assert all(self.mgr.is_swapped(s) for s in ids)

    @precondition(lambda self: self.mgr is not None and self.swapped_ids())
    @rule(data=st.data(), then_decode=st.booleans())
    def swap_in(self, data, then_decode):
        """Swap in; when can_swap_in(ids, 1) said yes, one more token each must then fit."""
        ids = data.draw(st.lists(st.sampled_from(self.swapped_ids()), min_size=1, unique=True))
        can_grow = self.mgr.can_swap_in(ids, 1)
        can = self.mgr.can_swap_in(ids)
        before = self.snapshot()
        pairs = self.mgr.swap_in(ids)
        assert (pairs is not None) == can
        if pairs is None:
            assert self.snapshot() == before
            return
        assert len({c for c, _ in pairs}) == len({d for _, d in pairs}) == len(pairs)
        self.shadow.swap_in(pairs)
        if then_decode and can_grow:
            for seq_id in ids:
                if self.mgr.num_tokens(seq_id) < self.max_len:
                    self.tokens[seq_id] = self.tokens[seq_id][:self.mgr.num_tokens(seq_id)] + [0]
                    num_tokens = self.mgr.num_tokens(seq_id)
                    copies = self.mgr.allocate_slots(seq_id, self.tokens[seq_id], 1)
                    assert copies is not None, "can_swap_in(ids, 1) promised room for a token"
                    self.shadow.copy_blocks(copies)
                    self.shadow.write(self.mgr.get_block_table(seq_id), self.tokens[seq_id],
                                      num_tokens, num_tokens + 1)

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self):
        if self.mgr is None:
            return
        self.mgr.check_invariants()
        stats = self.mgr.get_stats()
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_blocks
        assert stats.num_swapped_seqs == len(self.swapped_ids())
        used: set[int] = set()
        for seq_id in self.device_ids():
            table = self.mgr.get_block_table(seq_id)
            num_tokens = self.mgr.num_tokens(seq_id)
            assert self.shadow.read(table, num_tokens) == self.tokens[seq_id][:num_tokens], \
                f"sequence {seq_id} reads back other tokens than it wrote"
            used.update(table)
        if isinstance(self.mgr, KVCacheManager):
            assert stats.num_used_blocks == len(used)
            for block in self.mgr.block_pool.cached.values():
                assert self.shadow.holds(block.block_id, block.block_hash.token_ids), \
                    f"cached block {block.block_id} does not hold the tokens of its hash"

    def teardown(self):
        if self.mgr is None:
            return
        for seq_id in list(self.tokens):
            self.mgr.free(seq_id)
        self.mgr.check_invariants()
        stats = self.mgr.get_stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
        assert stats.slots_allocated == stats.slots_filled == 0


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheMachine = KVCacheMachine.TestCase
