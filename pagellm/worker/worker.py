"""Worker: executes one step's plan on the device and answers with what it computed.

It owns the KV cache tensors (CacheEngine), the model runner and the sampler, and the only
per-sequence state of the model side: the random generators of seeded requests and the
grammar matchers of structured outputs (``TokenMasks``). It reads the
``SchedulerOutput`` and nothing else of the scheduler (with tensor parallelism each rank would
run one on the broadcast plan), and returns a ``ModelRunnerOutput`` keyed by sequence id: all
the torch work (logits, log-softmax, top-k, sampling) happens here, none in pagellm.core.

Under tensor parallelism every rank has a Worker over its shard of the model and of the KV
cache and runs the same plan (cache operations and forward); only the driver's (rank 0,
``is_driver``) samples and answers, the others return an empty output.
"""
from __future__ import annotations

import torch

from pagellm.core.plan import (ModelRunnerOutput, PromptLogprob, SampledToken,
                               ScheduledSequence, SchedulerOutput)
from pagellm.lora.manager import LoRAManager
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.grammar import TokenMasks
from pagellm.worker.model_runner import ModelRunner, logits_rows
from pagellm.worker.sampler import (Sampler, SamplerOutput, SamplingMetadata, compute_logprobs,
                                    has_penalties)


class Worker:
    """Invariant: ``generators`` holds one generator per live seeded sequence (sample id),
    created the first time the sequence samples and dropped when the plan reports it
    finished, so a seeded sample depends only on its seed, its index and its own history."""

    def __init__(self, cache_engine: CacheEngine, runner: ModelRunner, sampler: Sampler,
                 device: torch.device, lora_manager: LoRAManager | None = None,
                 token_masks: TokenMasks | None = None,
                 is_driver: bool = True) -> None:
        self.cache_engine = cache_engine
        self.runner = runner
        self.sampler = sampler
        self.device = device
        self.is_driver = is_driver
        self.generators: dict[str, torch.Generator] = {}
        self.lora_manager = lora_manager  # the adapter slots, with enable_lora
        # structured outputs' grammar state, per live sequence (see worker/grammar.py)
        self.token_masks = token_masks or TokenMasks(None, sampler.vocab_size)

    def shutdown(self) -> None:
        """Nothing to stop in one process (the executors' shutdown stops their workers)."""

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in plan.finished_seq_ids:
            self.generators.pop(seq_id, None)
            self.token_masks.drop(seq_id)
        self._apply_cache_ops(plan)
        output = ModelRunnerOutput()
        if plan.is_empty:
            return output
        logits = self.runner.execute(plan.scheduled, self._lora_slots(plan))  # [rows, vocab]
        if not self.is_driver:
            return output
        sample_rows: list[int] = []
        sample_seqs: list[tuple[ScheduledSequence, int]] = []  # (sequence, sample index)
        row = 0
        for item in plan.scheduled:
            num_rows = logits_rows(item)
            if item.need_prompt_logits:
                output.prompt_logprobs[item.seq_id] = self._prompt_logprobs(
                    item, logits[row:row + num_rows])
            row += num_rows
            if item.need_logits:  # its last row; several samples for a forking prompt
                for index in range(len(item.sample_ids)):
                    sample_rows.append(row - 1)
                    sample_seqs.append((item, index))
        if sample_seqs:
            # Rows 0..n-1 in order (plain decode batches) need no gathered copy of the logits.
            picked = (logits[:len(sample_rows)] if sample_rows == list(range(len(sample_rows)))
                      else logits[sample_rows])
            sampled = self.sampler(picked, self._sampling_metadata(sample_seqs))
            for i, (item, _) in enumerate(sample_seqs):
                output.sampled.setdefault(item.seq_id, []).append(_sampled_token(sampled, i))
        return output

    def _lora_slots(self, plan: SchedulerOutput) -> list[int] | None:
        """The adapter slot of each scheduled sequence (-1: none), its adapters made resident;
        None when no sequence of the step has an adapter."""
        loras = [item.lora_request for item in plan.scheduled]
        if self.lora_manager is None or not any(loras):
            return None
        slots = self.lora_manager.activate(lora for lora in loras if lora is not None)
        return [-1 if lora is None else slots[lora.lora_int_id] for lora in loras]

    def _apply_cache_ops(self, plan: SchedulerOutput) -> None:
        """In the plan's order (SchedulerOutput)."""
        if plan.blocks_to_copy_first:
            self.cache_engine.copy_blocks(plan.blocks_to_copy_first)
        if plan.blocks_to_swap_out:
            self.cache_engine.swap_out(plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            self.cache_engine.swap_in(plan.blocks_to_swap_in)
        if plan.blocks_to_copy:
            self.cache_engine.copy_blocks(plan.blocks_to_copy)

    def _sampling_metadata(self, rows: list[tuple[ScheduledSequence, int]]) -> SamplingMetadata:
        params, prompts, outputs, generators = [], [], [], []
        for item, index in rows:
            p = item.params
            params.append(p)
            # only penalties and min_tokens read the token history: skip the copies otherwise
            history = p.min_tokens or has_penalties(p)
            prompts.append(item.token_ids[:item.num_prompt_tokens] if history else ())
            outputs.append(item.token_ids[item.num_prompt_tokens:] if history else ())
            generators.append(self._generator(item, index) if p.seed is not None else None)
        return SamplingMetadata(params, prompts, outputs, generators,
                                self.token_masks.build(rows, self.device))

    def _generator(self, item: ScheduledSequence, index: int) -> torch.Generator | None:
        seed = item.params.seed
        if seed is None:
            return None
        sample_id = item.sample_ids[index]
        generator = self.generators.get(sample_id)
        if generator is None:
            sample_index = int(sample_id.rpartition("#")[2] or 0)
            if sample_index:
                seed = (seed * 1_000_003 + sample_index) % (1 << 63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[sample_id] = generator
        return generator

    @staticmethod
    def _prompt_logprobs(item: ScheduledSequence, logits: torch.Tensor
                         ) -> list[tuple[int, PromptLogprob]]:
        """Row i predicts token ``num_computed_tokens + i + 1``; only prompt tokens count."""
        start = item.num_computed_tokens
        num_rows = min(logits.shape[0], item.num_prompt_tokens - 1 - start)
        if num_rows <= 0:
            return []
        targets = torch.tensor(list(item.token_ids[start + 1:start + 1 + num_rows]),
                               device=logits.device)
        result = compute_logprobs(logits[:num_rows], targets,
                                  [item.prompt_logprobs] * num_rows)
        return [(start + i + 1, PromptLogprob(result.token_ids[i], result.logprobs[i],
                                              result.ranks[i], result.top_logprobs[i] or []))
                for i in range(num_rows)]


def _sampled_token(sampled: SamplerOutput, i: int) -> SampledToken:
    if sampled.logprobs is None:
        return SampledToken(sampled.token_ids[i])
    return SampledToken(sampled.token_ids[i], sampled.logprobs[i], sampled.ranks[i],
                        sampled.top_logprobs[i])
