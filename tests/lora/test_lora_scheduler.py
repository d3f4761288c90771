"""The scheduler's adapter limit, without a model: a step holds at most ``max_loras``
distinct adapters; a request whose adapter would be one too many waits, those behind it with
an adapter already in the step (or none) go ahead, and every request completes."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
from scheduler_helpers import make_request, make_scheduler, step  # noqa: E402

from pagellm.lora.request import LoRARequest  # noqa: E402


def adapter(lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")


def test_step_never_holds_more_adapters_than_slots():
    scheduler = make_scheduler(max_num_seqs=8, budget=256)
    scheduler.config.max_loras = 2
    lora_ids = [1, 2, 3, 1, None, 3, 2]
    requests = []
    for i, lora_id in enumerate(lora_ids):
        request = make_request(f"r{i}", prompt_len=6, max_tokens=3, arrival_time=float(i))
        request.lora_request = None if lora_id is None else adapter(lora_id)
        scheduler.add_request(request)
        requests.append(request)
    plan, _ = step(scheduler)
    first = [item.seq_id for item in plan.scheduled]
    # r2 and r5 (adapter 3) wait; r3 (adapter 1), r4 (none) and r6 (adapter 2) go ahead
    assert first == ["r0#0", "r1#0", "r3#0", "r4#0", "r6#0"]
    assert {item.lora_request.lora_int_id for item in plan.scheduled if item.lora_request} \
        == {1, 2}
    for _ in range(20):
        if not scheduler.num_unfinished():
            break
        plan, _ = step(scheduler)
        assert len({item.lora_request.lora_int_id for item in plan.scheduled
                    if item.lora_request}) <= 2
    assert all(request.is_finished for request in requests)
    assert all(len(r.seqs[0].output_token_ids) == 3 for r in requests)


def test_no_limit_without_lora():
    scheduler = make_scheduler(max_num_seqs=8, budget=256)
    for i in range(3):
        request = make_request(f"r{i}", prompt_len=4)
        request.lora_request = adapter(i + 1)
        scheduler.add_request(request)
    plan, _ = step(scheduler)
    assert len(plan.scheduled) == 3
