"""Faults inside an engine step: one request's fault fails that request only (its output carries
the error, its blocks are freed) while the others run to the end; a fault of the engine itself
(every step failing) stops it with EngineDeadError."""
from __future__ import annotations

import pytest
from engine_helpers import make_prompts

from pagellm import LLM, SamplingParams
from pagellm.core.engine import MAX_CONSECUTIVE_FAILED_STEPS, EngineDeadError

GREEDY = dict(temperature=0.0, ignore_eos=True)
VOCAB = 512


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_gpu_blocks_override=256, block_size=4, max_model_len=256,
               enable_prefix_caching=True, max_num_seqs=8)


def _run(engine, requests: dict[str, list[int]], max_tokens: int = 6) -> dict:
    for rid, prompt in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, **GREEDY))
    final = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _assert_clean(engine) -> None:
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    engine.kv.check_invariants()


def test_an_out_of_vocabulary_sample_fails_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine
    prompts = make_prompts(3, [9, 14, 11], seed=21)
    expected = _run(engine, {f"ref-{i}": p for i, p in enumerate(prompts)})
    real = engine.worker.execute_model

    def poisoned(plan):
        out = real(plan)
        for seq_id, samples in out.sampled.items():
            if seq_id.startswith("bad-1"):
                samples[0].token_id = VOCAB  # what a NaN row once gave
        return out

    monkeypatch.setattr(engine.worker, "execute_model", poisoned)
    final = _run(engine, {f"bad-{i}": p for i, p in enumerate(prompts)})
    assert "out of range" in final["bad-1"].error and final["bad-1"].finished
    assert final["bad-1"].error_internal  # the engine's fault: the server answers 500
    for i in (0, 2):
        assert final[f"bad-{i}"].error is None
        assert final[f"bad-{i}"].outputs[0].token_ids == expected[f"ref-{i}"].outputs[0].token_ids
    _assert_clean(engine)


def test_an_output_processing_fault_fails_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine
    processor = engine.output_processor
    real = processor._add_token

    def faulty(seq, sample, scheduler):
        if seq.request.request_id == "dec-0":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real(seq, sample, scheduler)

    monkeypatch.setattr(processor, "_add_token", faulty)
    final = _run(engine, {f"dec-{i}": p for i, p in enumerate(make_prompts(2, [7], seed=3))})
    assert "output processing failed" in final["dec-0"].error and final["dec-0"].error_internal
    assert final["dec-1"].error is None and len(final["dec-1"].outputs[0].token_ids) == 6
    _assert_clean(engine)


def test_a_transient_worker_fault_fails_the_step_and_the_engine_serves_on(llm, monkeypatch):
    engine = llm.llm_engine
    real = engine.worker.execute_model
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("transient fault")
        return real(plan)

    monkeypatch.setattr(engine.worker, "execute_model", flaky)
    final = _run(engine, {"t-0": make_prompts(1, [10], seed=4)[0]})
    assert "transient fault" in final["t-0"].error and final["t-0"].error_internal
    later = _run(engine, {"t-1": make_prompts(1, [10], seed=4)[0]})
    assert later["t-1"].error is None and len(later["t-1"].outputs[0].token_ids) == 6
    assert engine.num_consecutive_failed_steps == 0
    _assert_clean(engine)


def test_a_persistent_worker_fault_is_the_engines_own(llm, monkeypatch):
    engine = llm.llm_engine

    def broken(plan):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.worker, "execute_model", broken)
    prompts = make_prompts(MAX_CONSECUTIVE_FAILED_STEPS, [8], seed=5)
    with pytest.raises(EngineDeadError, match="device lost"):
        for i, p in enumerate(prompts):
            _run(engine, {f"dead-{i}": p})
    monkeypatch.undo()
    _assert_clean(engine)
    engine.num_consecutive_failed_steps = 0  # the module's engine serves the next tests


def test_min_tokens_that_bans_every_token_is_refused(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=list(range(VOCAB)))
    with pytest.raises(ValueError, match="min_tokens=3 bans every one of the 512 tokens"):
        engine.add_request("banned", "hello", params)
    ok = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=list(range(VOCAB - 1)),
                        ignore_eos=True)
    assert _run(engine, {"almost": [5, 6, 7]})["almost"].error is None
    engine.add_request("almost-banned", [5, 6, 7], ok)
    engine.abort_request("almost-banned")
    _assert_clean(engine)
