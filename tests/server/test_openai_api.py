"""The server driven by the official ``openai`` client, checked against the offline API."""
from __future__ import annotations

import httpx
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL_NAME, get_stats

from pagellm import SamplingParams

PROMPT = "Explain how PagedAttention works."
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a block table?"}]
IGNORE_EOS = {"ignore_eos": True}  # the random model may emit EOS early; keep lengths exact


def greedy(llm, prompt, max_tokens: int):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), use_tqdm=False)[0]


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_greedy_completion_matches_offline_api_with_exact_usage(client, reference_llm):
    expected = greedy(reference_llm, PROMPT, 24)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                    temperature=0, extra_body=IGNORE_EOS)
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == len(expected.prompt_token_ids) + 24
    assert out.id.startswith("cmpl-") and out.object == "text_completion"


def test_streamed_completion_equals_non_streamed_and_reports_usage(client, reference_llm):
    expected = greedy(reference_llm, PROMPT, 24).outputs[0].text
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_batch_of_prompts_with_n2_keeps_order(client, reference_llm):
    prompts = ["The quick brown fox", "Numbers: 0 1 2"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, n=2,
                                    temperature=0, extra_body=IGNORE_EOS)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        text = greedy(reference_llm, prompt, 8).outputs[0].text
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == text
    assert out.usage.completion_tokens == 4 * 8


def test_n2_sampling_and_seed_reproducibility(client):
    def sample(seed):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, n=2,
                                        temperature=1.0, seed=seed, extra_body=IGNORE_EOS)
        assert len(out.choices) == 2 and out.usage.completion_tokens == 32
        return [c.text for c in out.choices]

    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]  # two samples of one request differ
    assert any(sample(seed) != first for seed in (8, 9))


def test_stop_string_cuts_text_streaming_or_not(client, reference_llm):
    full = greedy(reference_llm, PROMPT, 32).outputs[0].text
    stop = full[10:13]
    assert full.index(stop) == 10, "pick a stop string that occurs first at 10"
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32,
                                    temperature=0, stop=[stop], extra_body=IGNORE_EOS)
    assert out.choices[0].text == full[:10]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32,
                                       temperature=0, stop=stop, stream=True,
                                       extra_body=IGNORE_EOS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:10]


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                    temperature=0, logprobs=3, extra_body=IGNORE_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text or "\ufffd" in "".join(lp.tokens)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Keyed by text, so distinct ids that decode alike (e.g. to U+FFFD) share one key.
        assert token in top and len(top) <= 4 and chosen <= 0
        assert all(v <= chosen + 1e-5 for v in top.values())  # greedy picks the top
    assert max(len(top) for top in lp.top_logprobs) >= 3


def test_echo_prepends_prompt(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                    temperature=0, echo=True, extra_body=IGNORE_EOS)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, reference_llm):
    """OpenAI's legacy way to score a text (and vLLM's): the prompt, its tokens' logprobs,
    no completion, streamed or not."""
    expected = reference_llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                      use_tqdm=False)[0]
    prompt_ids = expected.prompt_token_ids
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt_ids) and lp.token_logprobs[0] is None
        want = [entry[token].logprob for token, entry in zip(prompt_ids[1:],
                                                             expected.prompt_logprobs[1:])]
        assert all(abs(got - w) < 1e-4 for got, w in zip(lp.token_logprobs[1:], want))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens,
            out.usage.total_tokens) == (len(prompt_ids), 0, len(prompt_ids))
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0,
                                            echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        len(prompt_ids), 0)


def test_max_tokens_0_without_echo_is_a_400_that_names_echo(server):
    response = httpx.post(f"{server.url}/v1/completions",
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert "allowed with echo=true" in response.json()["error"]["message"]


def test_chat_greedy_matches_offline_chat_streaming_or_not(client, reference_llm):
    expected = reference_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16,
                                                           ignore_eos=True), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
                                         temperature=0, extra_body=IGNORE_EOS)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_n2_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                         n=2, temperature=0.8, seed=3, logprobs=True,
                                         top_logprobs=2, extra_body=IGNORE_EOS)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_tokenize_detokenize_round_trip(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT},
                        headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]},
                      headers=headers).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES},
                      headers=headers).json()
    assert chat["count"] > tokens["count"]


def test_metrics_and_stats_reflect_served_requests(client, server):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).text
    names = ["num_requests_running", "num_requests_waiting", "num_requests_swapped",
             "kv_cache_usage_perc", "kv_cache_waste_perc", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "num_preemptions_total", "num_swaps_total",
             "prompt_tokens_total", "generation_tokens_total", "request_success_total",
             "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
             "e2e_request_latency_seconds_bucket"]
    values = _parse_metrics(text)
    for name in names:
        assert f"pagellm:{name}" in values, name
    assert values["pagellm:generation_tokens_total"] > 0
    assert values["pagellm:request_success_total"] > 0
    assert values["pagellm:time_to_first_token_seconds_count"] > 0
    assert values["pagellm:inter_token_latency_seconds_count"] > 0
    assert values["pagellm:e2e_request_latency_seconds_count"] > 0
    stats = get_stats(server)
    assert stats["generation_tokens_total"] == values["pagellm:generation_tokens_total"]
    for key in ("num_blocks", "num_free_blocks", "num_cached_blocks", "kv_usage",
                "kv_waste_ratio", "seq_block_counts"):
        assert key in stats


def _parse_metrics(text: str) -> dict[str, float]:
    """Sum of each metric's samples over its labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values
