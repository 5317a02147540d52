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
`workers.actors.rank_group` starts them. A request's KV leaves or enters a tensor-parallel engine whole,
as one host copy of all its heads (`ExportedKV`), so a move works between engines of any rank
count: for an export every rank copies its heads to host and rank 0 gathers and joins them; for
an import rank 0 splits the heads and scatters each rank its share, over a gloo group of the ranks
(`host_group`) so that the copies never pass through GPU memory. A call that fails on rank 0
after it was sent leaves the ranks out of step: every later call is refused, so the worker fails
its requests instead of hanging, and must be replaced. A rank that hangs without dying leaves rank 0
waiting inside a shared call; `LeadRunner.stalled` says so once the wait is long enough, and the
worker's stats poll then fails like a dead rank's.

    export:  rank k: copy its heads' blocks to host --gather--> rank 0: join along the head axis
    import:  rank 0: split along the head axis --scatter--> rank k: its share as a swap copy
"""

import time
from dataclasses import replace

import torch

from kv_kernels import BlockPoolShape, KVKernelBackend, backend_for_device
from workers.engine.logprobs import split_scores
from workers.engine.model_runner import ModelRunner
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.scheduler_output import ScheduledChunk

STOP = "stop"
# Runner calls the other ranks repeat; anything else changes rank 0's state only (or is refused).
FOLLOWED_CALLS = frozenset({"forward", "swap_out", "swap_in", "drop_swapped"})
# Calls whose host copies of a share of the heads every rank sends to rank 0, which joins them.
GATHERED_CALLS = frozenset({"copy_to_host", "swapped_copy"})
IMPORT = "import_swapped"  # rank 0 scatters a whole copy's head shares; each rank keeps its own

HostKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [blocks, block_size, heads, head_dim]


def check_ranks(tensor_parallel_size: int) -> None:
    """Raise ValueError unless torch.distributed runs `tensor_parallel_size` ranks and this is rank 0."""
    import torch.distributed as dist

    running = dist.is_available() and dist.is_initialized()
    if not running or dist.get_world_size() != tensor_parallel_size or dist.get_rank() != 0:
        found = f"{dist.get_world_size()} ranks, this one rank {dist.get_rank()}" if running else "none running"
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs torch.distributed running that many "
                         f"ranks with the engine on rank 0 and `workers.engine.tensor_parallel.follow_engine` on the "
                         f"others ({found})")


def _broadcast(call: tuple | None) -> tuple:
    import torch.distributed as dist

    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def host_group():
    """A gloo group of every rank, for the host copies of moved KV: with nccl, the object collectives would
    stage each pickled copy in GPU memory, which the KV pool has mostly taken. Every rank must call this
    once, in the same order as its other collectives (rank 0 when its `LeadRunner` is built, the followers
    in `follow_engine` when they have the settings)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _gather(share: HostKV | None, group) -> list[HostKV | None] | None:
    """Every rank's `share`, in rank order, on rank 0 (None on the others)."""
    import torch.distributed as dist

    shares = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(share, shares, dst=0, group=group)
    return shares


def _scatter(shares: list[HostKV] | None, group) -> HostKV:
    """This rank's element of rank 0's `shares` (one per rank; None on the others)."""
    import torch.distributed as dist

    box = [None]
    dist.scatter_object_list(box, shares, src=0, group=group)
    return box[0]


def _forward_and_wait(runner: ModelRunner, inputs, want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward, returned once the device has run it. On CUDA a forward only queues kernels (the ranks'
    all-reduces among them): without the wait, a hung rank would hold up the sampler after rank 0 had left
    the shared call, and `LeadRunner.stalled` would never see it."""
    out = runner.forward(inputs, want_hidden)
    runner.wait_for_device()
    return out


def _gather_from(runner: ModelRunner, group, name: str, *args) -> list[HostKV] | None:
    """Make the host-copy call `name` on this rank's runner and gather the copies on rank 0."""
    share = getattr(runner, name)(*args)
    runner.wait_for_device()  # copies into pinned memory are asynchronous
    return _gather(share, group)


def join_heads(shares: list[HostKV]) -> HostKV:
    """Per layer, the ranks' head shares side by side: rank r holds the r-th contiguous slice of the KV heads
    (AutoTP splits k_proj and v_proj by output rows in rank order), so joining in rank order restores them."""
    return [(torch.cat([share[layer][0] for share in shares], dim=2),
             torch.cat([share[layer][1] for share in shares], dim=2)) for layer in range(len(shares[0]))]


def split_heads(layers: HostKV, world_size: int) -> list[HostKV]:
    """The inverse of `join_heads`: each rank's contiguous slice of the KV heads, per layer."""
    shares = [[] for _ in range(world_size)]
    for k, v in layers:
        for rank, (k_share, v_share) in enumerate(zip(k.chunk(world_size, dim=2), v.chunk(world_size, dim=2))):
            shares[rank].append((k_share.contiguous(), v_share.contiguous()))
    return shares


class LeadRunner:
    """Rank 0's runner: sends every call that touches the model or the KV pool to the other ranks, then
    makes it on its own `ModelRunner`. Read-only attributes (`pool_shape`, `path`, `last_times`, ...) are
    the wrapped runner's."""

    def __init__(self, runner: ModelRunner) -> None:
        check_ranks(runner.tensor_parallel_size)
        self.runner = runner
        self.host_group = host_group()  # the followers make theirs in follow_engine, at the same point
        self.num_calls_sent = 0
        self.closed = False
        self.broken: str | None = None  # why the ranks fell out of step, once they have
        # (call name, monotonic start) while rank 0 is inside a call the other ranks share; one tuple, so the
        # actor's stats poll, on another thread, reads both halves of the same call
        self.in_call: tuple[str, float] | None = None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _send(self, name: str, *args) -> None:
        if self.closed:
            raise RuntimeError("the follower ranks were released (Engine.close); this engine cannot run again")
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel ranks are out of step since rank 0 failed a call they made "
                               f"({self.broken}); the worker must be replaced")
        self.in_call = (name, time.monotonic())  # until `_local` returns: the followers make it meanwhile
        try:
            _broadcast((name, args))
        except BaseException as error:  # some ranks may have the call and others not
            self.broken = f"sending {name}: {type(error).__name__}: {error}"
            self.in_call = None
            raise
        self.num_calls_sent += 1

    def _local(self, call, *args):
        """Make a call the followers were sent; if it fails here, the ranks are out of step for good."""
        try:
            return call(*args)
        except BaseException as error:
            self.broken = f"{type(error).__name__}: {error}"
            raise
        finally:
            self.in_call = None

    def stalled(self, after_s: float) -> str | None:
        """Why the ranks look hung: rank 0 has been inside one shared call (its collectives wait for every
        rank) for more than `after_s` seconds; None otherwise."""
        in_call = self.in_call
        if in_call is None:
            return None
        waited_s = time.monotonic() - in_call[1]
        return f"rank 0 has waited {waited_s:.0f} s in {in_call[0]} for the other ranks" if waited_s > after_s else None

    def run(self, chunks: list[ScheduledChunk], want_hidden: bool = False) -> tuple:
        """As `ModelRunner.run`, every rank forwarding the same inputs."""
        start_s = time.perf_counter()
        inputs, sampling_chunks, spans = self.runner.prepare(chunks)
        self._send("forward", inputs, want_hidden)
        packed_s = time.perf_counter() - start_s
        logits, hidden = self._local(_forward_and_wait, self.runner, inputs, want_hidden)
        self.runner.last_times.prepare_s += packed_s
        return split_scores(logits, hidden, sampling_chunks, spans)

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

    @property
    def transfer_shape(self) -> BlockPoolShape:
        """The pool as a moved request's KV sees it: every rank's heads together."""
        shape = self.runner.pool_shape
        return replace(shape, num_kv_heads=shape.num_kv_heads * self.runner.tensor_parallel_size)

    def copy_to_host(self, block_ids: list[int]) -> HostKV:
        """Host copies of `block_ids` with every rank's heads (each rank copies its own; rank 0 joins them)."""
        self._send("copy_to_host", list(block_ids))
        return join_heads(self._local(_gather_from, self.runner, self.host_group, "copy_to_host", block_ids))

    def swapped_copy(self, seq_id: str) -> HostKV | None:
        """A swapped-out sequence's host blocks with every rank's heads (a new copy), or None."""
        if self.runner.swapped_copy(seq_id) is None:
            return None  # nothing held here, nor on the followers (they swap exactly when rank 0 does)
        self._send("swapped_copy", seq_id)
        return join_heads(self._local(_gather_from, self.runner, self.host_group, "swapped_copy", seq_id))

    def import_swapped(self, seq_id: str, layers: HostKV) -> None:
        """Take a whole host copy from elsewhere as `seq_id`'s swap copy, each rank its share of the heads."""
        shares = split_heads(layers, self.runner.tensor_parallel_size)
        self._send(IMPORT, seq_id)
        self._local(self.runner.import_swapped, seq_id, self._local(_scatter, shares, self.host_group))

    def close(self) -> None:
        """Release the follower ranks (their `follow` returns); idempotent. Ranks out of step are not sent
        anything: they may wait in another collective, and the worker is replaced with them."""
        if not self.closed:
            if self.broken is None:
                _broadcast((STOP, ()))
            self.closed = True


def follow(runner: ModelRunner, group) -> int:
    """Make rank 0's runner calls on this rank, in order, until it closes; returns the calls made."""
    num_calls = 0
    while True:
        name, args = _broadcast(None)
        if name == STOP:
            return num_calls
        if name in GATHERED_CALLS:
            _gather_from(runner, group, name, *args)
        elif name == IMPORT:
            runner.import_swapped(*args, _scatter(None, group))
        elif name in FOLLOWED_CALLS:
            getattr(runner, name)(*args)
        else:
            raise RuntimeError(f"rank 0 sent {name!r}, which is not a runner call the ranks share")
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
    runner = ModelRunner(model, num_blocks, config.cache.block_size, backend or backend_for_device(device),
                         config.tensor_parallel_size, max_model_len=config.max_model_len, use_fast_path=False)
    return follow(runner, host_group())
