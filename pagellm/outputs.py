"""What a request returns: vLLM's output classes, with the same attribute names.

They are plain dataclasses so that code written against vLLM
(``out.outputs[0].text``, ``out.outputs[0].logprobs[i][token_id].logprob``) works unchanged.
What an output holds follows the request's ``SamplingParams.output_kind``: everything so far
(CUMULATIVE, the default), what is new since its previous output (DELTA), or everything once,
at the end (FINAL_ONLY). ``RequestOutput.merge`` joins consecutive deltas.
"""
from __future__ import annotations

from dataclasses import dataclass

# Per generated (or prompt) token: token id -> Logprob, holding the chosen token and the top-k.
LogprobsDict = dict[int, "Logprob"]


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token under the model's raw distribution.

    ``rank`` is 1 for the most likely token. ``decoded_token`` is the token's text on its own,
    filled in when the engine detokenises logprobs.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is None while generating, then ``"stop"`` (EOS, a stop token or a stop
    string), ``"length"`` (max_tokens or the context length) or ``"abort"``. ``stop_reason`` is
    the stop string or stop token id that ended it, None for EOS and for other reasons.
    ``logprobs`` has one dict per generated token when the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={_summarise_logprobs(self.logprobs)}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as seen by the user.

    ``prompt_logprobs`` has one entry per prompt token when requested; the first is None since
    nothing predicts the first token. ``error`` is set when the engine had to finish the request
    without generating (e.g. it can never fit in the KV cache); ``finished`` is then True.
    ``error_internal``: the error is a fault of the engine's own (a failed step, the output
    processing), not of the request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error_internal: bool = False

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This DELTA output followed by a ``later`` one of the same request, as one delta
        (what a consumer that fell behind receives)."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                by_index[c.index] = c
                continue
            by_index[c.index] = CompletionOutput(
                c.index, mine.text + c.text, mine.token_ids + c.token_ids,
                c.cumulative_logprob,
                None if c.logprobs is None else (mine.logprobs or []) + c.logprobs,
                c.finish_reason, c.stop_reason)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            [by_index[i] for i in sorted(by_index)], later.finished, later.metrics,
            later.error, later.num_cached_tokens, later.error_internal)

    def __repr__(self) -> str:
        error = f", error={self.error!r}" if self.error is not None else ""
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={_summarise_ids(self.prompt_token_ids)}, "
                f"prompt_logprobs={_summarise_logprobs(self.prompt_logprobs)}, "
                f"outputs={self.outputs!r}, finished={self.finished}, "
                f"metrics={self.metrics!r}, num_cached_tokens={self.num_cached_tokens}{error})")


def _summarise_ids(ids: list[int], limit: int = 16) -> str:
    """Long prompts would drown the repr; show the ends and the length."""
    if len(ids) <= limit:
        return repr(ids)
    head = ", ".join(map(str, ids[: limit // 2]))
    tail = ", ".join(map(str, ids[-limit // 2:]))
    return f"[{head}, ..., {tail}] ({len(ids)} tokens)"


def _summarise_logprobs(logprobs: list | None) -> str:
    return "None" if logprobs is None else f"<{len(logprobs)} positions>"
