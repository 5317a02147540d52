"""Tensor parallelism: one engine over several ranks of one node.

Rank 0 runs the whole engine (scheduler, allocator, sampler, length probe) and its share of the
model; every other rank runs only a `ModelRunner` over its share. DeepSpeed AutoTP splits each
decoder linear across the ranks (`wrap_with_deepspeed`), and each rank's KV pool holds 1/tp of
the KV heads in the same number of blocks. So the block tables, slots and swaps rank 0 decides
hold on every rank, and the only thing the ranks must share is the runner's calls: `LeadRunner`
sends each call (its name and plain arguments) before making it, and `follow` makes the same
calls in the same order on the other ranks. Inside a forward, AutoTP's all-reduces keep the ranks
in lock-step; every rank ends with the full logits, and rank 0 samples.

    rank 0:  schedule -> send(forward, inputs) -> forward (all-reduce) -> sample -> ...
    rank k:              recv(forward, inputs) -> forward (all-reduce)

torch.distributed must already run the ranks (gloo on CPU, nccl on CUDA); in the service,
`workers.rank_group` starts them. A request moved off or onto a tensor-parallel engine is
recomputed (each rank holds only a share of its KV). A call that fails on rank 0 after it was
sent leaves the ranks out of step: every later call is refused, so the worker fails its
requests instead of hanging, and must be replaced.
"""

import time

import torch

from kv_kernels import KVKernelBackend, backend_for_device
from workers.engine_config import EngineConfig
from workers.kv_cache_manager import BlockAllocator
from workers.model_runner import ModelRunner
from workers.scheduler import ScheduledChunk

STOP = "stop"
# Runner calls the other ranks repeat; anything else changes rank 0's state only (or is refused).
FOLLOWED_CALLS = frozenset({"forward", "swap_out", "swap_in", "drop_swapped"})


def check_ranks(tensor_parallel_size: int) -> None:
    """Raise ValueError unless torch.distributed runs `tensor_parallel_size` ranks and this is rank 0."""
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if not running or dist.get_world_size() != tensor_parallel_size or dist.get_rank() != 0:
        found = f"{dist.get_world_size()} ranks, this one rank {dist.get_rank()}" if running else "none running"
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs torch.distributed running that many "
                         f"ranks with the engine on rank 0 and `workers.tensor_parallel.follow_engine` on the "
                         f"others ({found})")


def _broadcast(call: tuple | None) -> tuple:
    import torch.distributed as dist

    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class LeadRunner:
    """Rank 0's runner: sends every call that touches the model or the KV pool to the other ranks, then
    makes it on its own `ModelRunner`. Read-only attributes (`pool_shape`, `path`, `last_times`, ...) are
    the wrapped runner's."""

    def __init__(self, runner: ModelRunner) -> None:
        check_ranks(runner.tensor_parallel_size)
        self.runner = runner
        self.num_calls_sent = 0
        self.closed = False
        self.broken: str | None = None  # why the ranks fell out of step, once they have

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _send(self, name: str, *args) -> None:
        if self.closed:
            raise RuntimeError("the follower ranks were released (Engine.close); this engine cannot run again")
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel ranks are out of step since rank 0 failed a call they made "
                               f"({self.broken}); the worker must be replaced")
        _broadcast((name, args))
        self.num_calls_sent += 1

    def _local(self, call, *args):
        """Make a call the followers were sent; if it fails here, the ranks are out of step for good."""
        try:
            return call(*args)
        except BaseException as error:
            self.broken = f"{type(error).__name__}: {error}"
            raise

    def run(self, chunks: list[ScheduledChunk], allocator: BlockAllocator,
            want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, list[ScheduledChunk]]:
        start_s = time.perf_counter()
        inputs, sampling_chunks = self.runner.prepare(chunks, allocator)
        self._send("forward", inputs, want_hidden)
        packed_s = time.perf_counter() - start_s
        logits, hidden = self._local(self.runner.forward, inputs, want_hidden)
        self.runner.last_times.prepare_s += packed_s
        return logits, hidden, sampling_chunks

    def swap_out(self, seq_id: str, block_ids: list[int]) -> int:
        self._send("swap_out", seq_id, list(block_ids))
        return self._local(self.runner.swap_out, seq_id, block_ids)

    def swap_in(self, seq_id: str, block_ids: list[int]) -> int:
        self._send("swap_in", seq_id, list(block_ids))
        return self._local(self.runner.swap_in, seq_id, block_ids)

    def drop_swapped(self, seq_id: str) -> None:
        if self.runner.swapped_copy(seq_id) is None:
            return  # nothing held here, nor on the followers (they swap exactly when rank 0 does)
        self._send("drop_swapped", seq_id)
        self._local(self.runner.drop_swapped, seq_id)

    def _whole_kv(self, *args, **kwargs):
        raise ValueError(f"moving a request's KV is not built for tensor parallelism: each of the "
                         f"{self.runner.tensor_parallel_size} ranks holds a share of its KV heads")

    copy_to_host = swapped_copy = import_swapped = _whole_kv

    def close(self) -> None:
        """Release the follower ranks (their `follow` returns); idempotent."""
        if not self.closed:
            _broadcast((STOP, ()))
            self.closed = True


def follow(runner: ModelRunner) -> int:
    """Make rank 0's runner calls on this rank, in order, until it closes; returns the calls made."""
    num_calls = 0
    while True:
        name, args = _broadcast(None)
        if name == STOP:
            return num_calls
        if name not in FOLLOWED_CALLS:
            raise RuntimeError(f"rank 0 sent {name!r}, which is not a runner call the ranks share")
        getattr(runner, name)(*args)
        num_calls += 1


def send_config(config: EngineConfig, num_blocks: int) -> None:
    """Rank 0: hand the engine's settings and its pool's block count to the follower ranks (their
    `follow_engine` waits for them), so every rank's pool has rank 0's geometry whatever each measured
    (free GPU memory differs per rank)."""
    _broadcast(("config", (config, num_blocks)))


def follow_engine(model: torch.nn.Module, backend: KVKernelBackend | None = None) -> int:
    """A follower rank: takes rank 0's engine settings and block count, builds this rank's share of `model`
    and of the KV pool, then repeats rank 0's calls until it closes. Returns the calls made."""
    name, args = _broadcast(None)
    if name != "config":
        raise RuntimeError(f"rank 0 sent {name!r} before the engine's settings")
    config, num_blocks = args
    device = next(model.parameters()).device
    runner = ModelRunner(model, num_blocks, config.block_size, backend or backend_for_device(device),
                         config.tensor_parallel_size, max_model_len=config.max_model_len, use_fast_path=False)
    return follow(runner)
