"""ModelRunner: which logits rows come back, in which order, and what a bad plan raises."""
from __future__ import annotations

import pytest
import torch
from helpers import random_prompts

from pagellm.model import load_model
from pagellm.worker.cache_engine import CacheEngine
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq


@pytest.fixture(scope="module")
def runner(model_zoo) -> ModelRunner:
    path, _ = model_zoo("llama")
    model, config = load_model(path)
    return ModelRunner(model, CacheEngine(config, 64, 0, 8, torch.float32, "cpu"), "cpu")


def test_rows_follow_batch_order_and_lm_head_sees_only_them(runner, monkeypatch):
    a, b, c, d = random_prompts([20, 9, 12, 5], seed=3)
    seen_rows = []
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits",
                        lambda h: seen_rows.append(h.shape[0]) or compute_logits(h))
    # Fill the caches of c and d first so that they can decode below.
    runner.execute([ScheduledSeq(c, 0, 11, [10, 11], False),
                    ScheduledSeq(d, 0, 4, [12], False)])
    batch = [
        ScheduledSeq(c, 11, 1, [10, 11], need_logits=True),  # decode, listed first
        ScheduledSeq(a, 0, 20, [0, 1, 2], need_logits=True, need_prompt_logits=True),
        ScheduledSeq(d, 4, 1, [12], need_logits=False),  # computes, returns nothing
        ScheduledSeq(b, 0, 6, [4, 5], need_logits=False),  # a chunk: nothing either
    ]
    logits = runner.execute(batch)
    assert seen_rows[-1] == 1 + 20 and logits.shape == (21, 512)
    assert logits.dtype == torch.float32
    # Each row equals the same position computed in a batch of its own (other blocks), so
    # rows come in the caller's order: c's decode row, then a's 20 prompt rows.
    alone_a = runner.execute([ScheduledSeq(a, 0, 20, [30, 31, 32], True, True)])
    torch.testing.assert_close(logits[1:], alone_a, atol=1e-5, rtol=0)
    alone_c = runner.execute([ScheduledSeq(c, 0, 12, [40, 41], need_logits=True)])
    torch.testing.assert_close(logits[:1], alone_c, atol=1e-5, rtol=0)


def test_no_rows_needed_skips_the_vocabulary_projection(runner, monkeypatch):
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: pytest.fail("lm_head ran"))
    prompt = random_prompts([10], seed=4)[0]
    logits = runner.execute([ScheduledSeq(prompt, 0, 10, [0, 1], need_logits=False)])
    assert logits.shape == (0, 512)
    assert runner.execute([]).shape == (0, 512)


@pytest.mark.parametrize("seq, message", [
    (ScheduledSeq([5] * 10, 0, 0, [0, 1], True), "computes >= 1"),
    (ScheduledSeq([5] * 10, 8, 3, [0, 1], True), "exceeds the 10 known tokens"),
    (ScheduledSeq([5] * 20, 0, 17, [0, 1], True), "need 3 blocks"),
    (ScheduledSeq([5] * 10, 0, 10, [0, 64], True), "outside the cache's 64 blocks"),
])
def test_bad_plans_raise_clear_errors(runner, seq, message):
    with pytest.raises(ValueError, match=message):
        runner.execute([seq])
