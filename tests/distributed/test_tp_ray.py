"""``distributed_executor_backend="ray"`` on a local Ray instance: rank 1 is a Ray actor
placed by a placement group, and two ranks give the single rank's greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
from tp_engines import BASE_KWARGS, assert_same_outputs, greedy, prompts

import pagellm
from pagellm import LLM, SamplingParams
from pagellm.core.plan import ScheduledSequence, SchedulerOutput


@pytest.fixture(scope="module")
def local_ray():
    import ray

    # the actors import the same pagellm as this process
    source_root = str(Path(pagellm.__file__).resolve().parent.parent)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": source_root, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def test_ray_actors_give_the_same_tokens(engines, tiny_models, local_ray):
    engines.close()  # one process group per process
    params = greedy(logprobs=5)
    expected = engines.get("qwen2").generate(prompts(), params, use_tqdm=False)
    llm = LLM(str(tiny_models("qwen2")), tensor_parallel_size=2,
              distributed_executor_backend="ray", **BASE_KWARGS)
    try:
        executor = llm.llm_engine.worker
        assert len(executor.actors) == 1
        assert_same_outputs(expected, llm.generate(prompts(), params, use_tqdm=False))
        bad = SchedulerOutput([ScheduledSequence("bad", [5, 6, 7], 0, 3, [10**6], True,
                                                 params=SamplingParams(), sample_ids=("bad",))])
        with pytest.raises(ValueError, match="outside the cache's"):  # on both ranks
            executor.execute_model(bad)
        assert executor.dead is None
        assert_same_outputs(expected[:1], llm.generate(prompts()[:1], params, use_tqdm=False))
    finally:
        llm.shutdown()
    assert local_ray.util.placement_group_table(executor.placement_group)["state"] == "REMOVED"


def test_ranks_on_one_host_are_counted_together_by_the_ram_check(tiny_models, local_ray):
    """The placement group put the actor on this host beside the driver: a KV cache each rank
    could hold alone but not both together is refused (each rank counts the ranks on its
    host), where each rank checking only itself would start and run out of RAM later."""
    from pagellm.worker.engine_setup import available_ram_bytes

    per_rank = int(0.6 * available_ram_bytes())
    settings = {**BASE_KWARGS, "kv_cache_memory_bytes": per_rank}
    with pytest.raises(ValueError, match=r"bytes x 2 ranks on this host\) exceeds the \d+ "
                                         r"bytes of RAM available"):
        LLM(str(tiny_models("qwen2")), tensor_parallel_size=2,
            distributed_executor_backend="ray", **settings)
