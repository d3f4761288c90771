"""After each step: tokens to text, stop strings, logprobs with their text, RequestOutputs.

Token-level stops (EOS, stop token ids, length) are the scheduler's; stop strings need the
text, so they are checked here, after it (vLLM's order: EOS and stop tokens once min_tokens
is met, then stop strings, then length; a stop string found in the token that reached the
length limit still wins), and a hit finishes the sequence through the scheduler.

What an output carries is chosen once per request (``SamplingParams.output_kind``):
CUMULATIVE (everything so far, vLLM's default), DELTA (only what is new since the request's
last output: what a stream sends) or FINAL_ONLY (one output, when the request finishes).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagellm.core.detokenizer import IncrementalDetokenizer
from pagellm.core.plan import PromptLogprob, SampledToken
from pagellm.core.request import Request, Sequence, SequenceStatus
from pagellm.core.stop_strings import StopStringMatcher, truncate_at_stop
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler, StepUpdate

logger = logging.getLogger("pagellm")


class OutputProcessor:
    """Per-token bookkeeping after sampling and the user-facing outputs. Holds no torch."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoded: dict[int, str] = {}

    def process(self, update: StepUpdate, scheduler: Scheduler) -> list[RequestOutput]:
        """Apply one step's new tokens; return the outputs of the requests that progressed."""
        for seq, sample in update.new_tokens:
            if seq.request.error is not None:
                continue
            try:
                self._add_token(seq, sample, scheduler)
            except Exception as exc:  # noqa: BLE001 - one request's failure, not the engine's
                logger.exception("request %s failed in output processing",
                                 seq.request.request_id)
                seq.request.error = f"output processing failed: {exc!r}"
                seq.request.error_internal = True
                scheduler.abort_request(seq.request)
        outputs = []
        for request in sorted(update.requests.values(), key=lambda r: r.seq_no):
            output = self.make_output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _add_token(self, seq: Sequence, sample: SampledToken, scheduler: Scheduler) -> None:
        params = seq.request.params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
        new_text = seq.detokenizer.add_token(sample.token_id)
        seq.text += new_text
        if seq.logprobs is not None and sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
            seq.logprobs.append(self._logprob_dict(sample.token_id, sample.logprob,
                                                   sample.rank, sample.top or ()))
        if params.stop and new_text:
            self._check_stop_strings(seq, new_text, scheduler)
        if seq.status.is_finished and not isinstance(seq.stop_reason, str):
            # release what the detokenizer held back (an incomplete multi-byte character)
            seq.text += seq.detokenizer.flush()

    @staticmethod
    def _check_stop_strings(seq: Sequence, new_text: str, scheduler: Scheduler) -> None:
        """Feed the new text to the sequence's stop-string automaton (also below min_tokens,
        so that a stop string begun then is recognised once it completes); a match found once
        min_tokens is out finishes the sequence."""
        request = seq.request
        params = request.params
        if request.stop_matcher is None:
            request.stop_matcher = StopStringMatcher(params.stop)
        seq.stop_state, best = request.stop_matcher.feed(seq.stop_state, new_text)
        if (best is None or seq.status is SequenceStatus.FINISHED_STOPPED
                or seq.num_output_tokens < params.min_tokens):
            return
        stop_str = params.stop[best[1]]
        start = len(seq.text) - len(new_text) + best[0]
        seq.text = truncate_at_stop(seq.text, start, stop_str, params.include_stop_str_in_output)
        scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, stop_str)

    # ------------------------------------------------------------------ logprobs
    def decode_token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(self, token_id: int, logprob: float, rank: int | None,
                      top: Any) -> dict[int, Logprob]:
        """The chosen token first, then the top ones (ranks count from 1 = most likely)."""
        out = {token_id: Logprob(logprob, rank, self.decode_token(token_id))}
        for r, (tid, lp) in enumerate(top, start=1):
            out.setdefault(tid, Logprob(lp, r, self.decode_token(tid)))
        return out

    def _record_prompt_logprobs(self, request: Request) -> None:
        """Turn the runner's prompt logprobs into dicts; a position recorded before (a
        recomputation after preemption) is not recorded twice."""
        for position, entry in request.pending_prompt_logprobs:
            if position == len(request.prompt_logprobs):
                entry: PromptLogprob
                request.prompt_logprobs.append(self._logprob_dict(
                    entry.token_id, entry.logprob, entry.rank, entry.top))
        request.pending_prompt_logprobs.clear()

    # ------------------------------------------------------------------ outputs
    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's output of the kind it asked for; None when that kind has nothing
        to say now (FINAL_ONLY before the end)."""
        if request.prompt_logprobs is not None and request.pending_prompt_logprobs:
            self._record_prompt_logprobs(request)
        kind = request.params.output_kind
        finished = request.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        seqs = request.seqs if len(request.seqs) == 1 else sorted(request.seqs,
                                                                   key=lambda s: s.index)
        completions = [self._completion(seq, delta) for seq in seqs]
        prompt_logprobs = request.prompt_logprobs
        if delta and request.prompt_logprobs_sent:
            prompt_logprobs = None
        request.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=completions, finished=finished, metrics=request.metrics,
            error=request.error, num_cached_tokens=request.num_cached_tokens or 0,
            error_internal=request.error_internal)

    @staticmethod
    def _completion(seq: Sequence, delta: bool) -> CompletionOutput:
        params = seq.request.params
        wants_logprobs = params.logprobs is not None
        tokens_from, text_from = (seq.num_sent_tokens, seq.num_sent_text) if delta else (0, 0)
        output_ids = seq.token_ids[seq.num_prompt_tokens + tokens_from:]
        text_to = len(seq.text)
        if delta:
            if not seq.status.is_finished:
                # hold back what could still turn out to start a stop string
                text_to = max(text_from, text_to - params.output_text_buffer_length)
            seq.num_sent_tokens += len(output_ids)
            seq.num_sent_text = text_to
        return CompletionOutput(
            index=seq.index, text=seq.text[text_from:text_to], token_ids=output_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=seq.logprobs[tokens_from:] if seq.logprobs is not None else None,
            finish_reason=seq.status.value if seq.status.is_finished else None,
            stop_reason=seq.stop_reason)
