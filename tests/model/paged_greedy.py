"""A minimal greedy generation loop over ModelRunner and KVCacheManager (no scheduler).

Every step schedules every unfinished sequence: the rest of its prompt (or a chunk of it),
else its one new token; slots come from the block manager, logits from the runner, the next
token is the argmax. Enough to check the model path against transformers token for token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagellm.kv import KVCacheManager, PrefixMatch
from pagellm.model import load_model
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated tokens of each prompt
    prompt_logits: list[torch.Tensor | None]  # [len(prompt), vocab] when recorded
    logprobs: list[list[float]]  # log-probability of each generated token
    logits: list[torch.Tensor]  # [generated, vocab] float32: the logits each token came from
    prefix_hits: list[int]  # prompt tokens served from cached blocks
    num_steps: int = 0


@dataclass
class _Seq:
    index: int
    prompt_len: int
    token_ids: list[int]
    num_computed: int = 0
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    prefix: PrefixMatch | None = None  # prefix-cache hit, used by the first allocation


class PagedGreedy:
    """A loaded model, its KV cache and block manager; ``generate`` may be called repeatedly
    (finished sequences leave their full blocks in the prefix index)."""

    def __init__(self, model_dir: Path | None, block_size: int = 16, num_blocks: int = 512,
                 dtype: torch.dtype = torch.float32, prefix_caching: bool = False,
                 loaded: tuple | None = None) -> None:
        """``loaded``: (model, hf_config) already loaded, instead of loading ``model_dir``."""
        model, hf_config = loaded or load_model(model_dir, dtype=dtype)
        self.cache = CacheEngine(hf_config, num_blocks, 0, block_size, dtype, "cpu")
        self.runner = ModelRunner(model, self.cache, "cpu")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self._next_id = 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 chunk_size: int | None = None, record_prompt_logits: bool = False
                 ) -> GreedyResult:
        seqs = [_Seq(i, len(p), list(p)) for i, p in enumerate(prompts)]
        ids = {s.index: self._new_id() for s in seqs}
        hits = [0] * len(seqs)
        for s in seqs:
            prefix = self.kv.lookup_prefix(s.token_ids)
            hits[s.index] = s.num_computed = prefix.num_tokens
            s.prefix = prefix
        active, steps = list(seqs), 0
        while active:
            batch = [self._schedule(s, ids[s.index], chunk_size, record_prompt_logits)
                     for s in active]
            logits = self.runner.execute(batch)
            row = 0
            for s, sched in zip(active, batch):
                row = self._consume(s, sched, logits, row)
            assert row == logits.shape[0]
            steps += 1
            for s in [s for s in active if len(s.token_ids) - s.prompt_len == max_new_tokens]:
                self.kv.free(ids[s.index])
                active.remove(s)
        self.kv.check_invariants()
        return GreedyResult(
            tokens=[s.token_ids[s.prompt_len:] for s in seqs],
            prompt_logits=[torch.cat(s.prompt_logits) if s.prompt_logits else None
                           for s in seqs],
            logprobs=[s.logprobs for s in seqs],
            logits=[torch.stack(s.logits) if s.logits else torch.empty(0) for s in seqs],
            prefix_hits=hits, num_steps=steps)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _schedule(self, s: _Seq, seq_id: int, chunk_size: int | None,
                  record_prompt_logits: bool) -> ScheduledSeq:
        remaining = len(s.token_ids) - s.num_computed
        num_new = min(remaining, chunk_size) if chunk_size else remaining
        copies = self.kv.allocate_slots(seq_id, s.token_ids, num_new, prefix=s.prefix)
        s.prefix = None
        assert copies is not None, "test KV cache too small"
        self.cache.copy_blocks(copies)
        return ScheduledSeq(s.token_ids, s.num_computed, num_new,
                            self.kv.get_block_table(seq_id),
                            need_logits=s.num_computed + num_new == len(s.token_ids),
                            need_prompt_logits=(record_prompt_logits
                                                and s.num_computed < s.prompt_len))

    @staticmethod
    def _consume(s: _Seq, sched: ScheduledSeq, logits: torch.Tensor, row: int) -> int:
        if sched.need_prompt_logits:
            s.prompt_logits.append(logits[row:row + sched.num_new_tokens])
            row += sched.num_new_tokens
            last = logits[row - 1] if sched.need_logits else None
        elif sched.need_logits:
            last = logits[row]
            row += 1
        else:
            last = None
        s.num_computed += sched.num_new_tokens
        if last is not None:
            token = int(last.argmax())
            s.logprobs.append(float(torch.log_softmax(last, -1)[token]))
            s.logits.append(last.float())
            s.token_ids.append(token)
        return row


def run_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
               **options) -> GreedyResult:
    """One-shot: build a PagedGreedy (block_size, num_blocks, dtype, prefix_caching) and
    generate (chunk_size, record_prompt_logits)."""
    gen_keys = ("chunk_size", "record_prompt_logits")
    gen_options = {k: options.pop(k) for k in gen_keys if k in options}
    return PagedGreedy(model_dir, **options).generate(prompts, max_new_tokens, **gen_options)
