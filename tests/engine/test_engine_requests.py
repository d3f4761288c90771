"""LLMEngine request handling: abort, errors, sampling options, forking, priorities."""
from __future__ import annotations

import math

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.core.engine import LLMEngine

from engine_helpers import hf_greedy, make_prompts, with_eos

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_gpu_blocks_override=512, block_size=16, max_model_len=512)


def _run(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.llm_engine
    prompts = make_prompts(3, [40, 70, 5], seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_blocks
    aborted = engine.abort_request(["r1", "nope"])
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    engine.abort_request(["r0", "r2"])
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.slots_allocated == 0
    engine.kv.check_invariants()


def test_too_long_prompt_is_rejected_and_engine_goes_on(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [5] * 600}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long2", {"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("bad", {"prompt_token_ids": [5, 10**6]}, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, SamplingParams())
    for not_int, name in ((1.5, "float"), (True, "bool"), ("7", "str")):
        with pytest.raises(ValueError, match=rf"token ids must be Python ints, got .* \({name}\)"):
            engine.add_request("typed", {"prompt_token_ids": [5, not_int]}, SamplingParams())
    for not_prompts in (None, 5):
        with pytest.raises(TypeError, match="prompts must be a str, a dict, a list of token ids"):
            llm.generate(not_prompts, use_tqdm=False)
    out = llm.generate((p for p in ["still serving"]), SamplingParams(max_tokens=3),
                       use_tqdm=False)  # any iterable of prompts
    assert len(out[0].outputs[0].token_ids) == 3


def test_seeded_sampling_reproducible_and_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("a seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
    batch = llm.generate(["x y z", "a seeded prompt", "another one", "and more"],
                         [others[0], params, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate("a seeded prompt", params.clone(), use_tqdm=False)
    assert different[0].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": make_prompts(1, [40], seed=2)[0]}
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8))
    engine.step()  # prompt computed, forked into 4 samples
    shared_used = engine.get_stats().num_blocks - engine.get_stats().num_free_blocks
    final = _run(engine)["n4"]
    assert len(final.outputs) == 4 and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    for i in range(4):
        engine.add_request(f"sep{i}", prompt, SamplingParams(temperature=1.0, max_tokens=8))
    engine.step()
    separate_used = engine.get_stats().num_blocks - engine.get_stats().num_free_blocks
    _run(engine)
    assert shared_used < separate_used
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def test_stop_token_ids_stop_strings_and_min_tokens(llm):
    base = llm.generate("stop conditions", SamplingParams(max_tokens=20, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    tokens, text = list(base.token_ids), base.text
    stop_tok = tokens[4]
    first = tokens.index(stop_tok)
    out = llm.generate("stop conditions", SamplingParams(max_tokens=20, stop_token_ids=[stop_tok],
                                                         **GREEDY), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    later = llm.generate("stop conditions", SamplingParams(
        max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 2, **GREEDY),
        use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) > first + 1
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    assert stop_str.strip(), text
    cut = text.index(stop_str)
    out = llm.generate("stop conditions", SamplingParams(max_tokens=20, stop=[stop_str], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_str
    kept = llm.generate("stop conditions", SamplingParams(
        max_tokens=20, stop=[stop_str], include_stop_str_in_output=True, **GREEDY),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + len(stop_str)]


def test_eos_and_ignore_eos(llama_dir, tmp_path):
    prompt = make_prompts(1, [30], seed=4)[0]
    greedy = hf_greedy(llama_dir, [prompt], 12)[0]
    eos = greedy[5]
    first = greedy.index(eos)
    model = with_eos(llama_dir, eos, tmp_path / "eos-model")
    llm = LLM(str(model), num_gpu_blocks_override=128, max_model_len=256)
    stopped = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert list(stopped.outputs[0].token_ids) == greedy[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason is None
    ignored = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
    assert list(ignored.outputs[0].token_ids) == greedy
    assert ignored.outputs[0].finish_reason == "length"


def test_logprobs_match_reference(llama_dir, llm):
    prompt = make_prompts(1, [25], seed=6)[0]
    tokens, ref = hf_greedy(llama_dir, [prompt], 6, return_logprobs=True)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert list(completion.token_ids) == tokens[0]
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = ref[0][step]
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert entry[token].rank == 1
        top = expected.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, len(prompt)))
    assert all(not math.isnan(d[prompt[i]].logprob) for i, d in enumerate(out.prompt_logprobs)
               if d)


def test_priority_policy_preempts_low_priority_first(llama_dir):
    args = EngineArgs(model=str(llama_dir), block_size=4, num_gpu_blocks_override=30,
                      max_model_len=100, scheduling_policy="priority", preemption_mode="swap",
                      swap_space=0.002)
    engine = LLMEngine.from_engine_args(args)
    prompts = make_prompts(2, [30, 30], seed=8)
    params = SamplingParams(max_tokens=60, **GREEDY)
    engine.add_request("low", {"prompt_token_ids": prompts[0]}, params, priority=5)
    engine.add_request("high", {"prompt_token_ids": prompts[1]}, params, priority=0)
    while engine.get_stats().num_preemptions == 0 and engine.has_unfinished_requests():
        engine.step()
    assert [s.request.request_id for s in engine.scheduler.swapped] == ["low"]
    final = _run(engine)
    assert final["high"].metrics.finished_time <= final["low"].metrics.finished_time
    assert engine.get_stats().num_free_blocks == 30


def test_contiguous_allocator_gives_the_same_samples(llama_dir):
    """The baseline allocator copies a forked reservation instead of sharing it: n = 2 seeded
    samples must come out the same as on the paged cache."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, [21, 7, 40], seed=12)]
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    results = {}
    for allocator in ("paged", "contiguous"):
        llm = LLM(str(llama_dir), kv_allocator=allocator, num_gpu_blocks_override=64,
                  block_size=8, max_model_len=128)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[allocator] = [[list(c.token_ids) for c in o.outputs] for o in outputs]
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_blocks
    assert results["paged"] == results["contiguous"]
    assert any(a != b for a, b in results["paged"]), "two samples should differ"


def test_request_that_can_never_fit_is_finished_with_an_error(llama_dir):
    """With nothing running or swapped and the head of the queue still unschedulable, the engine
    finishes that request with an error instead of retrying it for ever. add_request and
    start-up make this hard to reach, so blocks are taken away behind the scheduler's back."""
    args = EngineArgs(model=str(llama_dir), block_size=4, num_gpu_blocks_override=30,
                      max_model_len=100)
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("big", {"prompt_token_ids": make_prompts(1, [60], seed=3)[0]},
                       SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("next", {"prompt_token_ids": make_prompts(1, [6], seed=4)[0]},
                       SamplingParams(max_tokens=2, **GREEDY))
    assert engine.kv.allocate_slots("elsewhere", [0] * 100, 100) is not None  # 25 of 30 blocks
    outputs = engine.step()
    assert [(o.request_id, o.finished) for o in outputs] == [("big", True)]
    assert "cannot fit in the KV cache (30 blocks of 4 tokens)" in outputs[0].error
    assert not outputs[0].error_internal  # the request's fault: the server answers 400
    final = _run(engine)  # the next request still runs in the 5 blocks left
    assert list(final) == ["next"] and len(final["next"].outputs[0].token_ids) == 2
    engine.kv.free("elsewhere")
    assert engine.get_stats().num_free_blocks == 30
