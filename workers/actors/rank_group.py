"""The ranks of a tensor-parallel worker: one Ray placement group, rank 0 the `WorkerActor`, the others
`FollowerRank` actors.

    placement group "<worker actor>-ranks" (STRICT_PACK: one node)
      bundle 0: WorkerActor  rank 0  engine: scheduler, allocator, sampler; its share of the model
      bundle 1: FollowerRank rank 1  follow_engine: its share, repeating rank 0's runner calls
      ...

The worker pool creates the group and starts the `WorkerActor` in bundle 0; the actor starts the
followers in the other bundles, with the same resources, and every rank joins torch.distributed
(gloo on CPU, nccl on CUDA) at the actor's node address before the engines are built
(`workers.engine.tensor_parallel`). Followers are owned by the worker actor, so they die with it;
removing the group (the pool does when it kills the worker) frees their resources.

No torch import at module level: the controller imports this to create groups.
"""

import datetime
import os
from pathlib import Path

import ray

from workers.actors.ports import free_port


def rank_group_name(actor_name: str) -> str:
    """The placement group of the worker actor named `actor_name`."""
    return f"{actor_name}-ranks"


def rank_group(name: str, tensor_parallel_size: int, num_cpus: float, num_gpus: float):
    """A detached placement group of one bundle per rank on one node (what each rank's actor asks for)."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    return placement_group([bundle] * tensor_parallel_size, strategy="STRICT_PACK", name=name, lifetime="detached")


def remove_rank_group(name: str) -> bool:
    """Remove the named group (its actors die with it); False if there is none."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        group = get_placement_group(name)
    except ValueError:
        return False
    remove_placement_group(group)
    return True


# Followers wait in a collective for rank 0's next call, however long the worker stays idle: the default
# timeout (10 minutes) would end them after an idle spell.
RANK_TIMEOUT = datetime.timedelta(days=365)


def join_ranks(rank: int, world_size: int, address: str, port: int, device: str) -> None:
    """Join torch.distributed as `rank` of `world_size` (DeepSpeed's communication, which AutoTP uses)."""
    on_cuda = str(device).startswith("cuda")
    # Ray shows each rank's actor only its own GPU, which is then device 0 (DeepSpeed picks LOCAL_RANK's).
    local_rank = 0 if on_cuda else rank
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_SIZE=str(world_size))
    import deepspeed

    if on_cuda:
        import torch

        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", timeout=RANK_TIMEOUT, verbose=False)
    if not on_cuda:
        import torch.distributed

        torch.distributed.barrier()  # every rank has mapped every other rank's allreduce buffer
        allreduce_buffer_path(address, port, rank).unlink(missing_ok=True)


def allreduce_buffer_path(address: str, port: int, rank: int) -> Path:
    """Rank `rank`'s buffer for DeepSpeed's shared-memory allreduce on CPU (named so in DeepSpeed's
    ops/csrc/cpu/comm/shm.cpp, about 70 MB). DeepSpeed never unlinks it (a `make test` left 0.5 GB in /dev/shm);
    `join_ranks` does once every rank has it mapped, and the mapping lives on until the rank exits."""
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


class FollowerRank:
    """A follower rank of a tensor-parallel worker (no `@ray.remote`: `start_ranks` picks its options)."""

    def run(self, rank: int, world_size: int, address: str, port: int, settings, load_model) -> int:
        """Join the ranks, load this rank's share of the model (`load_model(settings)` -> model, tokenizer,
        device), repeat rank 0's runner calls until its engine closes; returns the calls made. Blocks for the
        worker's lifetime."""
        from workers.engine.runtime import tune_cpu_runtime
        from workers.engine.tensor_parallel import follow_engine

        tune_cpu_runtime(settings.num_torch_threads)
        model, _, device = load_model(settings)
        join_ranks(rank, world_size, address, port, device)
        return follow_engine(model)


def follower_name(actor_name: str, rank: int) -> str:
    """The Ray name of a named worker's follower `rank` (`ray.get_actor` finds it in the worker's namespace)."""
    return f"{actor_name}-rank{rank}"


def start_ranks(settings, group, load_model, actor_name: str | None = None, namespace: str | None = None
                ) -> tuple[list[tuple], "callable"]:
    """From rank 0 (the worker actor, in bundle 0 of `group`): start the follower ranks in the other bundles
    (each loads its model with `load_model(settings)`, `workers.actors.worker_actor.load_worker_model`, passed in so
    that this module does not import the actor's, then waits for the others), named
    `follower_name(actor_name, rank)` in `namespace` when the worker has a name (an actor cannot read its own
    namespace, so the pool passes it).

    Returns (actor handle, pending `run` call) per follower, to keep (an actor whose handles are all gone is
    stopped) and to watch (`ended_follower`), and the function rank 0 calls to join them once its own model
    is loaded, so that every rank loads at the same time."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.engine.device import probe_cuda, resolve_device

    world_size = settings.engine.tensor_parallel_size
    if group is None or len(group.bundle_specs) != world_size:
        found = "none" if group is None else f"{len(group.bundle_specs)} bundles"
        raise ValueError(f"tensor_parallel_size {world_size} needs a placement group of {world_size} bundles "
                         f"(workers.actors.rank_group.rank_group), got {found}")
    # The rendezvous listens on every interface: followers may run on other nodes.
    address, port = ray.util.get_node_ip_address(), free_port("")
    followers = []
    for rank in range(1, world_size):
        bundle = group.bundle_specs[rank]
        names = {"name": follower_name(actor_name, rank), "namespace": namespace} if actor_name else {}
        follower = ray.remote(FollowerRank).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0, **names,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote()
        followers.append((follower, follower.run.remote(rank, world_size, address, port, settings, load_model)))
    device = resolve_device(settings.device, *probe_cuda())
    return followers, lambda: join_ranks(0, world_size, address, port, device)


def ended_follower(followers: list[tuple]) -> str | None:
    """Which follower rank's `run` has ended, and how, or None while all still follow (`followers` as
    `start_ranks` returns them). Before the engine closes, a follower ends only by dying: rank 0's next
    collective then fails or waits for it forever."""
    runs = [run for _, run in followers]
    ended, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    for rank, run in enumerate(runs, start=1):
        if run not in ended:
            continue
        try:
            calls = ray.get(run, timeout=0)
        except Exception as error:  # noqa: BLE001 - how it died is the message
            first_line = (str(error).strip().splitlines() or ["(no message)"])[0][:200]
            return f"follower rank {rank} died ({type(error).__name__}: {first_line})"
        return f"follower rank {rank} stopped after {calls} calls"
    return None
