"""ModelRunner: turns a batch plan into tensors, runs the model, returns the needed logits.

The plan says, per sequence, which tokens to compute this step (``num_new_tokens`` tokens
after the ``num_computed_tokens`` already in the KV cache) and where its blocks are. One step
mixes whole prompts, prompt chunks, prompts after a prefix-cache hit and single-token decodes;
the runner packs them into one flat batch (prefills first, as attention wants them) and maps
the logits rows back to the caller's order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagellm.attention import AttentionMetadata
from pagellm.lora.layers import LoRAStepState
from pagellm.lora.ops import LoRABatch
from pagellm.model.decoder import CausalLM
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.cpu_decode import CpuDecodePlan
from pagellm.worker.cuda_graphs import DecodeGraphRunner, capture_sizes


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    ``token_ids`` holds every known token (prompt and generated); the step computes positions
    ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1`` whose slots the
    ``block_table`` already covers. ``need_logits``: return the logits of the last computed
    token (the sequence samples); ``need_prompt_logits``: return the logits of every computed
    token (prompt logprobs), which includes the last one.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    need_logits: bool
    need_prompt_logits: bool = False


def logits_rows(seq: ScheduledSeq) -> int:
    """Logits rows ``execute`` returns for a scheduled sequence, its last computed tokens':
    all of them for prompt logprobs (the last is also its sampling row), else one when it
    samples, else none. The one definition of the row layout."""
    return seq.num_new_tokens if seq.need_prompt_logits else int(seq.need_logits)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64, packed prefills first
    metadata: AttentionMetadata
    # [num_rows] int64: packed token of each returned row; None: every token, in order
    logits_indices: torch.Tensor | None
    lora_batch: LoRABatch | None = None  # the tokens by adapter slot (None: no adapter)


class ModelRunner:
    """Runs ``model`` over the KV cache of ``cache_engine``, one step per ``execute``."""

    def __init__(self, model: CausalLM, cache_engine: CacheEngine,
                 device: torch.device | str) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.device = torch.device(device)
        self.block_size = cache_engine.block_size
        self.vocab_size = model.config.vocab_size
        # Set by capture_decode_graphs (CUDA, unless enforce_eager): decode-only steps replay
        # a captured graph; everything else runs the model eagerly.
        self.decode_graphs: DecodeGraphRunner | None = None
        # Set on the CPU unless enforce_eager (engine_setup): decode-only steps call the
        # layers' kernels in a row (cpu_decode.py); everything else runs the model.
        self.cpu_decode: CpuDecodePlan | None = None
        # Set with enable_lora: the per-step token -> adapter slot map the LoRA layers read.
        self.lora_state: LoRAStepState | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward for batch sizes up to ``max_num_seqs`` (cuda_graphs.py)."""
        graphs = DecodeGraphRunner(self.model, self.cache_engine.kv_caches,
                                   capture_sizes(max_num_seqs), max_model_len, self.block_size,
                                   self.device)
        graphs.capture()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], lora_slots: list[int] | None = None
                ) -> torch.Tensor:
        """float32 logits [rows, vocab]: per sequence in batch order, ``num_new_tokens`` rows
        if need_prompt_logits, else 1 row (its last computed token) if need_logits, else none.
        The vocabulary projection runs only on those rows. ``lora_slots``: each sequence's
        adapter slot (-1: none), None when no sequence has one."""
        if not batch:
            return torch.empty(0, self.vocab_size, device=self.device)
        inputs = self.prepare_inputs(batch, lora_slots)
        if self.lora_state is not None:
            self.lora_state.batch = inputs.lora_batch
        hidden = None
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.metadata)
        elif self.cpu_decode is not None:
            hidden = self.cpu_decode.run(inputs.input_ids, inputs.metadata)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.metadata.positions,
                                self.cache_engine.kv_caches, inputs.metadata)  # [T, hidden]
        indices = inputs.logits_indices
        if indices is not None and indices.numel() == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self.model.compute_logits(hidden if indices is None else hidden[indices]).float()

    def prepare_inputs(self, batch: list[ScheduledSeq], lora_slots: list[int] | None = None
                       ) -> ModelInput:
        """Pack the batch (prefills, then decodes), validate it, build the step's metadata."""
        for seq in batch:
            self._check(seq)
        order = ([i for i, s in enumerate(batch) if s.num_new_tokens > 1]
                 + [i for i, s in enumerate(batch) if s.num_new_tokens == 1])
        packed = [batch[i] for i in order]
        query_lens = [s.num_new_tokens for s in packed]
        seq_lens = [s.num_computed_tokens + s.num_new_tokens for s in packed]
        input_ids: list[int] = []
        for seq, end in zip(packed, seq_lens):
            input_ids.extend(seq.token_ids[seq.num_computed_tokens:end])
        metadata = AttentionMetadata.build(query_lens, seq_lens, [s.block_table for s in packed],
                                           self.block_size, self.device)
        tables = metadata.block_tables  # one vectorised bounds check instead of one per seq
        if tables.numel() and (int(tables.min()) < 0
                               or int(tables.max()) >= self.cache_engine.num_blocks):
            raise ValueError(f"the block tables hold ids outside the cache's "
                             f"{self.cache_engine.num_blocks} blocks")
        lora_batch = None
        if lora_slots is not None:
            token_slots = [lora_slots[i] for i, n in zip(order, query_lens) for _ in range(n)]
            lora_batch = LoRABatch.build(token_slots, self.device)
        return ModelInput(torch.tensor(input_ids, dtype=torch.int64).to(self.device), metadata,
                          self._logits_indices(batch, order, query_lens), lora_batch)

    def _logits_indices(self, batch: list[ScheduledSeq], order: list[int],
                        query_lens: list[int]) -> torch.Tensor | None:
        """Packed token index of each logits row, rows in the caller's batch order; None
        where that is every packed token in order (a step of decodes only): no gather."""
        start_of = [0] * len(batch)
        offset = 0
        for i, query_len in zip(order, query_lens):
            start_of[i] = offset
            offset += query_len
        rows: list[int] = []
        for i, seq in enumerate(batch):
            end = start_of[i] + seq.num_new_tokens
            rows.extend(range(end - logits_rows(seq), end))
        if len(rows) == offset and rows == list(range(offset)):
            return None
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _check(self, seq: ScheduledSeq) -> None:
        end = seq.num_computed_tokens + seq.num_new_tokens
        if seq.num_new_tokens < 1 or seq.num_computed_tokens < 0:
            raise ValueError(f"a scheduled sequence computes >= 1 new token after >= 0 computed "
                             f"ones, got num_new_tokens={seq.num_new_tokens}, "
                             f"num_computed_tokens={seq.num_computed_tokens}")
        if end > len(seq.token_ids):
            raise ValueError(f"num_computed_tokens + num_new_tokens = {end} exceeds the "
                             f"{len(seq.token_ids)} known tokens")
        num_blocks = -(-end // self.block_size)
        if num_blocks > len(seq.block_table):
            raise ValueError(f"{end} tokens need {num_blocks} blocks of {self.block_size}, "
                             f"the block table has {len(seq.block_table)}")
