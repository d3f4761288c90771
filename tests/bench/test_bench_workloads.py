"""Workload generators: seeded, within their stated ranges, and readable from JSONL."""
from __future__ import annotations

import json

import pytest

from pagellm.bench.workloads import WorkloadSpec, build_workload


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "shared-prefix"])
def test_seeded_and_within_ranges(name):
    spec = WorkloadSpec(name=name, num_prompts=50, seed=3, input_len=(8, 40),
                        output_len=(2, 30), prefix_len=16 if name == "shared-prefix" else 0)
    first = build_workload(spec, vocab_size=100)
    again = build_workload(spec, vocab_size=100)
    other = build_workload(WorkloadSpec(**{**spec.to_dict(), "seed": 4}), vocab_size=100)
    assert [r.prompt_token_ids for r in first.requests] == [r.prompt_token_ids for r in again.requests]
    assert [r.prompt_token_ids for r in first.requests] != [r.prompt_token_ids for r in other.requests]
    prefix = 16 if name == "shared-prefix" else 0
    for r in first.requests:
        assert 8 + prefix <= r.prompt_len <= 40 + prefix
        assert 2 <= r.output_len <= 30
        assert all(3 <= t < 100 for t in r.prompt_token_ids)
    summary = first.summary()
    assert summary["output_tokens_total"] == sum(r.output_len for r in first.requests)
    assert summary["name"] == name


def test_shared_prefix_shares_its_prefix():
    spec = WorkloadSpec(name="shared-prefix", num_prompts=5, prefix_len=32, input_len=(4, 8))
    requests = build_workload(spec, vocab_size=1000).requests
    assert len({tuple(r.prompt_token_ids[:32]) for r in requests}) == 1
    assert len({tuple(r.prompt_token_ids[32:]) for r in requests}) == 5


def test_sharegpt_like_has_a_long_tail():
    spec = WorkloadSpec(name="sharegpt-like", num_prompts=400, input_len=(1, 4096),
                        output_len=(1, 4096))
    lens = sorted(r.prompt_len for r in build_workload(spec, vocab_size=1000).requests)
    median, p99 = lens[len(lens) // 2], lens[int(len(lens) * 0.99)]
    assert p99 > 4 * median


def test_dataset_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 4},
        {"prompt": "hello world"},
        {"prompt_token_ids": [9]},
    ]))

    class Tok:
        def encode(self, text):
            return [len(w) + 3 for w in text.split()]

    spec = WorkloadSpec(name="dataset", num_prompts=2, dataset=str(path), output_len=(7, 7))
    requests = build_workload(spec, vocab_size=100, tokenizer=Tok()).requests
    assert [r.prompt_token_ids for r in requests] == [[5, 6, 7], [8, 8]]
    assert [r.output_len for r in requests] == [4, 7]


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="workload 'nope'"):
        WorkloadSpec(name="nope")
    with pytest.raises(ValueError, match="input_len"):
        WorkloadSpec(input_len=(10, 5))
    with pytest.raises(ValueError, match="--dataset"):
        WorkloadSpec(name="dataset")
