"""One engine step end to end on a tiny model: output kinds, a step that fails or is
interrupted, prefix hits reported, n > 1 within max_num_seqs."""
from __future__ import annotations

import pytest
from engine_helpers import make_prompts

from pagellm import LLM, RequestOutputKind, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_gpu_blocks_override=256, block_size=4, max_model_len=256,
               enable_prefix_caching=True, max_num_seqs=4)


def _outputs(engine, request_id, prompt, params):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_output_kinds_carry_the_same_tokens(llm):
    engine = llm.llm_engine
    prompt = make_prompts(1, [9], seed=3)[0]
    runs = {kind: _outputs(engine, f"kind-{kind.name}", prompt,
                           SamplingParams(max_tokens=6, logprobs=1, output_kind=kind, **GREEDY))
            for kind in RequestOutputKind}
    cumulative = runs[RequestOutputKind.CUMULATIVE]
    final = cumulative[-1].outputs[0]
    assert len(cumulative) == 6 and final.finish_reason == "length"
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    (only,) = runs[RequestOutputKind.FINAL_ONLY]
    assert only.finished and only.outputs[0].token_ids == final.token_ids
    deltas = runs[RequestOutputKind.DELTA]
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 6
    assert sum((o.outputs[0].token_ids for o in deltas), []) == final.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    streamed = sum((o.outputs[0].logprobs for o in deltas), [])
    assert [list(d) for d in streamed] == [list(d) for d in final.logprobs]
    assert [d[t].logprob for d, t in zip(streamed, final.token_ids)] == pytest.approx(
        [d[t].logprob for d, t in zip(final.logprobs, final.token_ids)], abs=1e-4)
    merged = deltas[0]
    for later in deltas[1:]:
        merged = merged.merge(later)
    assert merged.outputs[0].token_ids == final.token_ids and merged.finished


def test_delta_text_holds_back_a_possible_stop_string(llm):
    """A DELTA stream never shows text that a stop string later cuts away."""
    engine = llm.llm_engine
    prompt = make_prompts(1, [12], seed=4)[0]
    full = _outputs(engine, "probe", prompt, SamplingParams(max_tokens=12, **GREEDY))[-1]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if len(stop) < 2:
        pytest.skip("the model's text is too short to hold a stop string")
    deltas = _outputs(engine, "stop-delta", prompt,
                      SamplingParams(max_tokens=12, stop=[stop],
                                     output_kind=RequestOutputKind.DELTA, **GREEDY))
    streamed = "".join(o.outputs[0].text for o in deltas)
    assert streamed == text[:text.index(stop)]
    assert deltas[-1].outputs[0].finish_reason == "stop"


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.llm_engine
    prompts = make_prompts(2, [20, 30], seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"fail-{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=4, **GREEDY))

    def broken(plan):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.worker, "execute_model", broken)
    outputs = engine.step()  # the step's requests fail; the engine does not
    monkeypatch.undo()
    assert sorted(o.request_id for o in outputs) == ["fail-0", "fail-1"]
    assert all(o.finished and "device lost" in o.error for o in outputs)
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    engine.kv.check_invariants()
    # nothing of the failed step is reused through the prefix cache: the same prompt again
    again = llm.generate([{"prompt_token_ids": prompts[1]}],
                         SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and len(again.outputs[0].token_ids) == 4


def test_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    """Defect: Ctrl-C in LLM.generate left its requests in the engine, holding blocks."""
    engine = llm.llm_engine
    calls = {"n": 0}
    real_step = engine.step

    def interrupted_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, [16, 25, 7], seed=6)]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
    out = llm.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)


def test_num_cached_tokens_reports_prefix_hits(llm):
    prompt = make_prompts(1, [33], seed=7)[0]
    params = SamplingParams(max_tokens=2, **GREEDY)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens % 4 == 0
    assert second.num_cached_tokens == 32  # every full block of 4 but the last token's
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_samples_count_against_max_num_seqs(llm):
    """Defect: with max_num_seqs=4, three requests with n=2 ran six sequences in a step."""
    engine = llm.llm_engine
    most = 0
    for i, p in enumerate(make_prompts(3, [10, 12, 14], seed=8)):
        engine.add_request(f"n2-{i}", {"prompt_token_ids": p},
                           SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=i))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        most = max(most, len(engine.scheduler.running))
    assert most <= 4
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 5 for c in o.outputs)
               for o in outs.values())
