"""The Ray executor: tensor-parallel ranks 1..N-1 as Ray actors, rank 0 in the driver, as
vLLM's ``distributed_executor_backend="ray"``. The actors may sit on other machines of a Ray
cluster, which is how a model larger than one machine's devices is split.

The driver joins the Ray cluster (``ray.init()``: the one ``RAY_ADDRESS`` or ``ray start``
names, else a new local instance; or the one the caller already initialised), reserves one
bundle per worker rank in a placement group (one GPU each on CUDA, one CPU on the CPU; packed
onto as few nodes as possible), and starts one actor per bundle. The ranks rendezvous on a
free port of the driver's node address (``tcp://<driver ip>:<port>``); from then on the
collectives go through torch.distributed (NCCL or gloo) between the machines, and Ray only
carries each step's plan to the actors and their acknowledgements back.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch

from pagellm.core.plan import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.executor import (STRAGGLER_GRACE_S, TIMEOUT_S, WorkerDiedError,
                                          start_driver_thread, worker_plan)
from pagellm.distributed.parallel_state import destroy_distributed, free_port, init_distributed

logger = logging.getLogger("pagellm")


class RankActor:
    """One worker rank inside a Ray actor: join the group, build the shard, run plans."""

    def __init__(self) -> None:
        self.worker: Any = None

    def start(self, spec: Any, rank: int, world_size: int, init_method: str, device_type: str,
              num_threads: int, local_ranks: int) -> int:
        from pagellm.worker.engine_setup import build_rank_worker

        torch.set_num_threads(num_threads)
        # Ray gives a GPU actor its device as the only visible one
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        group = init_distributed(rank, world_size, init_method, device, TIMEOUT_S)
        self.worker = build_rank_worker(spec, device, group, local_ranks).worker
        return os.getpid()

    def execute_model(self, plan: SchedulerOutput) -> None:
        self.worker.execute_model(plan)

    def shutdown(self) -> None:
        destroy_distributed()


def _ranks_per_node(placement_group: Any, bundles: int) -> list[int]:
    """For each rank (0: the driver, r: bundle r - 1), how many of the ranks share its node,
    whose RAM their CPU KV caches and swap spaces share."""
    import ray
    from ray.util.placement_group import placement_group_table

    bundle_nodes = placement_group_table(placement_group)["bundles_to_node_id"]
    nodes = [ray.get_runtime_context().get_node_id(),
             *(bundle_nodes[i] for i in range(bundles))]
    return [nodes.count(node) for node in nodes]


class RayExecutor:
    """Runs each step on the driver (rank 0) and ``tensor_parallel_size - 1`` Ray actors.

    Invariant: while ``dead`` is None every actor has answered every plan sent to it."""

    # the Worker's interface; LoRA is refused with tensor parallelism (check_tensor_parallel)
    lora_manager = None

    def __init__(self, spec: Any, device: torch.device) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagellm.worker.engine_setup import build_rank_worker

        self.world_size = spec.args.tensor_parallel_size
        self.dead: str | None = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        bundle = {"GPU": 1} if device.type == "cuda" else {"CPU": 1}
        self.placement_group = placement_group([bundle] * (self.world_size - 1),
                                               strategy="PACK")
        self.actors: list[Any] = []
        try:
            ray.get(self.placement_group.ready(), timeout=TIMEOUT_S)
            local_ranks = _ranks_per_node(self.placement_group, self.world_size - 1)
            host = ray.util.get_node_ip_address()
            init_method = f"tcp://{host}:{free_port(host)}"
            actor_class = ray.remote(num_cpus=0 if device.type == "cuda" else 1,
                                     num_gpus=1 if device.type == "cuda" else 0)(RankActor)
            self.actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=i)).remote()
                for i in range(self.world_size - 1)]
            starts = [actor.start.remote(spec, rank, self.world_size, init_method,
                                         device.type, torch.get_num_threads(),
                                         local_ranks[rank])
                      for rank, actor in enumerate(self.actors, start=1)]
            self.tp_group, self.driver = self._start_driver(
                spec, device, init_method, functools.partial(build_rank_worker,
                                                             local_ranks=local_ranks[0]), starts)
        except BaseException:
            self.shutdown()
            raise

    def _start_driver(self, spec: Any, device: torch.device, init_method: str, build,
                      starts: list[Any]) -> tuple[Any, Any]:
        """Build rank 0 in a helper thread while waiting for the actors, so that an actor
        that fails to start is reported at once."""
        import ray

        thread, result = start_driver_thread(self.world_size, spec, device, init_method, build)
        pending, deadline = list(starts), time.monotonic() + TIMEOUT_S
        while pending or thread.is_alive():
            if pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
                ray.get(done)  # raises the actor's start-up error
            thread.join(0.05)
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the tensor-parallel Ray actors did not start within "
                                      f"{TIMEOUT_S:.0f} s (PAGELLM_TP_TIMEOUT_S)")
        if "error" in result:
            raise result["error"]
        return result["ok"]

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        message = worker_plan(plan)
        refs = [actor.execute_model.remote(message) for actor in self.actors]
        error: Exception | None = None
        output = ModelRunnerOutput()
        try:
            output = self.driver.worker.execute_model(plan)
        except Exception as exc:  # noqa: BLE001 - decided once the actors answered
            error = exc
        # after a failure here the actors may be blocked in a collective this rank left
        timeout = STRAGGLER_GRACE_S if error is not None else TIMEOUT_S
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            raise self._fail(f"{len(pending)} tensor-parallel Ray actor(s) did not answer "
                             f"within {timeout:.0f} s")
        failures = []
        for rank, ref in enumerate(refs, start=1):
            try:
                ray.get(ref)
            except RayActorError as exc:
                raise self._fail(f"the tensor-parallel Ray actor of rank {rank} died: "
                                 f"{exc}") from exc
            except RayTaskError as exc:
                failures.append(f"rank {rank} failed the step: {exc}")
        if error is not None and len(failures) in (0, len(refs)):
            raise error  # the same failure on every rank, or only in this rank's sampling
        if failures:
            raise self._fail("the tensor-parallel ranks are out of step: " + "; ".join(failures))
        return output

    def _fail(self, reason: str) -> WorkerDiedError:
        if self.dead is None:
            self.dead = reason
            logger.error("%s: stopping the other tensor-parallel ranks", reason)
        self._kill_actors()
        return WorkerDiedError(self.dead)

    def _kill_actors(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        """Leave the group on every rank, kill the actors, release the placement group
        (and the Ray instance this executor started)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.actors and self.dead is None:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=10)
            except Exception:  # noqa: BLE001 - killed below anyway
                pass
        self._kill_actors()
        self.actors = []
        destroy_distributed()
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - the cluster may be gone
            pass
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
