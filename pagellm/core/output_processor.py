"""Turning sampled tokens into text, stop decisions and RequestOutputs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagellm.core.detokenizer import IncrementalDetokenizer, check_stop_strings
from pagellm.core.request import Request, Sequence, SequenceStatus
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput

if TYPE_CHECKING:
    from pagellm.worker.sampler import SamplerOutput


class OutputProcessor:
    """Per-token bookkeeping after sampling: detokenise, decide whether a sequence stops and
    why (vLLM's order: EOS and stop tokens once min_tokens is met, then stop strings, then
    length), and build the user-facing outputs."""

    def __init__(self, tokenizer: Any, hf_config: Any, max_model_len: int,
                 eos_token_ids: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = (eos_token_ids if eos_token_ids is not None
                              else _eos_token_ids(tokenizer, hf_config))
        self._decoded: dict[int, str] = {}

    def new_detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        params = seq.request.params
        return IncrementalDetokenizer(
            self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)

    def update(self, seq: Sequence) -> None:
        """Account for the token just appended to ``seq``; may mark it finished."""
        request = seq.request
        params = request.params
        token = seq.token_ids[-1]
        new_text = seq.detokenizer.add_token(token)
        seq.text += new_text
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                return
            if params.stop and new_text:
                hit = check_stop_strings(seq.text, len(new_text), params.stop,
                                         params.include_stop_str_in_output)
                if hit is not None:
                    seq.text, seq.stop_reason = hit
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    return
        if num_output >= request.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def finish(self, seq: Sequence) -> None:
        """A finished sequence releases the text its detokenizer held back (an incomplete
        multi-byte character), unless a stop string already cut the text."""
        if not isinstance(seq.stop_reason, str):
            seq.text += seq.detokenizer.flush()

    # ------------------------------------------------------------------ logprobs
    def decode_token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprob_dict(self, logprobs: torch.Tensor, token_id: int, k: int) -> dict[int, Logprob]:
        """``logprobs``: [vocab] log-probabilities of one position. The chosen token first, then
        the top ``k`` (ranks count from 1 = most likely)."""
        chosen = float(logprobs[token_id])
        rank = int((logprobs > chosen).sum()) + 1
        out = {token_id: Logprob(chosen, rank, self.decode_token(token_id))}
        if k:
            values, ids = torch.topk(logprobs, k)
            for r, (tid, lp) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
                out.setdefault(tid, Logprob(lp, r, self.decode_token(tid)))
        return out

    def token_logprobs(self, sampled: SamplerOutput, i: int) -> dict[int, Logprob]:
        token = sampled.token_ids[i]
        out = {token: Logprob(sampled.logprobs[i], sampled.ranks[i], self.decode_token(token))}
        for rank, (tid, lp) in enumerate(sampled.top_logprobs[i] or (), start=1):
            out.setdefault(tid, Logprob(lp, rank, self.decode_token(tid)))
        return out

    # ------------------------------------------------------------------ outputs
    def build_request_output(self, request: Request) -> RequestOutput:
        wants_logprobs = request.params.logprobs is not None
        completions = [
            CompletionOutput(
                index=seq.index, text=seq.text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.status.value if seq.status.is_finished else None,
                stop_reason=seq.stop_reason)
            for seq in sorted(request.seqs, key=lambda s: s.index)]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, prompt_logprobs=request.prompt_logprobs,
            outputs=completions, finished=request.is_finished, metrics=request.metrics,
            error=request.error)


def _eos_token_ids(tokenizer: Any, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return frozenset(ids)
