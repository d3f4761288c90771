"""Tensor-parallel failures are clean: a worker killed mid-run makes the driver raise within
seconds and stops the others, a driver that dies takes its workers with it, and a
tensor_parallel_size the model cannot take is refused before anything starts."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import is_gone, random_prompts, wait_gone
from tp_engines import BASE_KWARGS

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.core.engine import EngineDeadError


def test_killing_a_worker_mid_run_raises_within_seconds(engines, tiny_models):
    engines.close()  # one process group per process
    llm = LLM(str(tiny_models("llama")), tensor_parallel_size=2, **BASE_KWARGS)
    engine = llm.llm_engine
    executor = engine.worker
    [pid] = executor.worker_pids
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = random_prompts([20, 30, 40, 50], vocab_size=512, seed=2)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    timer.start()
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDeadError, match=f"rank 1 \\(pid {pid}\\) died"):
        while time.monotonic() < deadline:  # keep it busy until the kill lands
            if not engine.has_unfinished_requests():
                for i, prompt in enumerate(prompts):
                    engine.add_request(f"{time.monotonic()}-{i}", prompt, params)
            engine.step()
    raised_at = time.monotonic()
    timer.join()
    assert killed_at and raised_at - killed_at[0] < 10
    assert not engine.has_unfinished_requests()  # the step's requests failed, none hang
    with pytest.raises(EngineDeadError):  # and it stays dead
        executor.execute_model(engine.scheduler.schedule())
    llm.shutdown()
    assert all(not p.is_alive() for p in executor.processes)
    assert not [p for p in multiprocessing.active_children() if p.pid == pid]
    assert is_gone(pid)


DRIVER = textwrap.dedent("""
    import sys, time
    from pagellm import LLM

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=256,
                  swap_space=0.05, kv_cache_memory_bytes=8 << 20)
        print(*llm.llm_engine.worker.worker_pids, flush=True)
        time.sleep(120)
""")


def test_workers_exit_when_the_driver_dies(tiny_models, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(script), str(tiny_models("llama"))],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = driver.stdout.readline()
        assert line.strip(), "the driver did not start its engine"
        pids = [int(p) for p in line.split()]
        assert pids and not any(is_gone(p) for p in pids)
        driver.kill()
        driver.wait(10)
        assert all(wait_gone(p, 10) for p in pids)
    finally:
        driver.kill()
        driver.wait(10)
        driver.stdout.close()


def test_heads_the_ranks_cannot_split_are_refused_before_anything_starts(tiny_models):
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the "
                                         r"model's num_attention_heads=4"):
        LLM(str(tiny_models("qwen2")), tensor_parallel_size=3, **BASE_KWARGS)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not divide the "
                                         r"model's num_attention_heads=4"):
        LLM(str(tiny_models("qwen3")), tensor_parallel_size=8, **BASE_KWARGS)
    with pytest.raises(ValueError, match=r"enable_lora=True with tensor_parallel_size=2"):
        LLM(str(tiny_models("qwen2")), tensor_parallel_size=2, enable_lora=True, **BASE_KWARGS)
    assert set(multiprocessing.active_children()) == children


def test_engine_args_check_the_backend():
    with pytest.raises(ValueError, match="distributed_executor_backend='threads'"):
        EngineArgs(model="m", distributed_executor_backend="threads").validate()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineArgs(model="m", tensor_parallel_size=0).validate()


def test_heads_per_rank():
    from pagellm.model.layers.linear import heads_per_rank
    from pagellm.model.layers.parallel import vocab_range

    assert heads_per_rank(32, 8, 4) == (8, 2)
    assert heads_per_rank(64, 8, 8) == (8, 1)
    assert heads_per_rank(12, 4, 2) == (6, 2)
    assert heads_per_rank(8, 2, 4) == (2, 1)  # each KV head on two ranks
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the "
                                         "model's num_key_value_heads=6"):
        heads_per_rank(12, 6, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=6 is not a multiple of the "
                                         "model's num_key_value_heads=4"):
        heads_per_rank(12, 4, 6)
    assert [vocab_range(509, r, 2) for r in range(2)] == [(0, 255, 255), (255, 254, 255)]


def test_command_line_flags():
    import argparse

    from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_flags(parser)
    args = engine_args_from(parser.parse_args(["m", "-tp", "2"]))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "mp")
    args = engine_args_from(parser.parse_args(
        ["m", "--tensor-parallel-size", "4", "--distributed-executor-backend", "ray"]))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (4, "ray")


def test_worker_plans_carry_only_the_steps_tokens():
    import pickle

    from pagellm.core.plan import ScheduledSequence, SchedulerOutput
    from pagellm.distributed.executor import worker_plan

    history = list(range(10, 2010))  # a 2,000-token sequence decoding its next token
    plan = SchedulerOutput([ScheduledSequence("s", history, 1999, 1, [0], True,
                                              params=SamplingParams(), sample_ids=("s",))],
                           blocks_to_copy=[(1, 2)])
    sent = pickle.loads(pickle.dumps(worker_plan(plan)))
    item = sent.scheduled[0]
    assert len(item.token_ids) == 2000 and item.token_ids[1999:2000] == (2009,)
    assert item.params is None and sent.blocks_to_copy == [(1, 2)]
    assert len(pickle.dumps(worker_plan(plan))) < 1000
    with pytest.raises(IndexError, match="outside the plan's window"):
        item.token_ids[0:5]


def test_a_kv_cache_too_small_is_refused_and_leaves_no_process(tiny_models):
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="the KV cache has 2 blocks of 16 tokens"):
        LLM(str(tiny_models("llama")), tensor_parallel_size=2,
            **{**BASE_KWARGS, "num_gpu_blocks_override": 2})
    assert set(multiprocessing.active_children()) == children
    llm = LLM(str(tiny_models("llama")), tensor_parallel_size=2, **BASE_KWARGS)  # and again
    llm.shutdown()
