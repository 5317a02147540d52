"""Cluster placement policy: which worker takes a request, where an overrun moves, how many workers to run.

Pure decisions over small dataclasses (no Ray, Redis or torch): the controller builds
`WorkerBudget`s and `PendingRequest`s from its store, asks these functions, and carries out
the answer. Sizes are KV blocks throughout; `blocks_for` converts tokens.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_WAIT_S = 5.0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens (ceil division)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class WorkerBudget:
    """A worker as placement sees it: its KV budget and what is already promised from it.

    Attributes:
        worker_id: the worker's id.
        num_total_blocks: KV blocks of the worker's cache.
        num_reserved_blocks: sum of the reservations placed there; may exceed the total after
            overruns were extended, in which case the worker has no free blocks.
        is_ready: only ready workers take new requests.
    """

    worker_id: str
    num_total_blocks: int
    num_reserved_blocks: int
    is_ready: bool = True

    def __post_init__(self) -> None:
        if self.num_total_blocks < 0:
            raise ValueError(f"worker {self.worker_id!r}: num_total_blocks must be >= 0, got {self.num_total_blocks}")
        if self.num_reserved_blocks < 0:
            raise ValueError(
                f"worker {self.worker_id!r}: num_reserved_blocks must be >= 0, got {self.num_reserved_blocks}")

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.num_total_blocks - self.num_reserved_blocks)


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request waiting for a worker.

    Attributes:
        request_id: the request's id.
        num_blocks: its reservation: prompt + predicted upper bound of the output, in blocks.
        arrival_s: when it started waiting (any clock, as long as `now_s` uses the same one).
    """

    request_id: str
    num_blocks: int
    arrival_s: float

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"request {self.request_id!r}: num_blocks must be >= 1, got {self.num_blocks}")


def first_fit_decreasing(pending: Sequence[PendingRequest], workers: Sequence[WorkerBudget],
                         now_s: float | None = None, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> dict[str, str]:
    """Place pending requests on workers by first-fit-decreasing of their reservations.

    Order of requests: first those *starved* (waiting at least `max_wait_s` at `now_s`),
    oldest first; then the rest, largest reservation first, ties by arrival, then id.

    Order of workers: ready workers only, sorted once per call by free blocks at the start of
    the call (most first), ties by worker id. The order is fixed during the call, so this is
    true first fit: it packs the roomiest worker before opening the next, and since each call
    re-sorts, successive calls still spread load.

    Reservations accumulate within the call, so no worker is promised more than its free
    blocks. A request that fits nowhere is left out of the result.

    Starvation guard: a starved request that does not fit now *holds* the worker with the most
    free blocks among those large enough to ever take it; no later request is placed there in
    this call, so that worker's free blocks grow as its sequences finish until the starved
    request fits, instead of being taken by a stream of smaller, newer requests. A request
    larger than every ready worker's whole cache cannot be helped and holds nothing (the
    caller should reject such requests before they wait).

    Args:
        pending: requests waiting to be placed.
        workers: the pool, with current reservations.
        now_s: the current time on the same clock as `arrival_s`; None disables the guard.
        max_wait_s: waiting time after which a request is placed before any newer one.

    Returns:
        request_id -> worker_id for every request placed.
    """
    if max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
    _check_unique([r.request_id for r in pending], "request_id")
    _check_unique([w.worker_id for w in workers], "worker_id")

    ready = sorted((w for w in workers if w.is_ready), key=lambda w: (-w.num_free_blocks, w.worker_id))
    num_free = {w.worker_id: w.num_free_blocks for w in ready}
    held: set[str] = set()
    placements: dict[str, str] = {}
    for request in _placement_order(pending, now_s, max_wait_s):
        target = next((w.worker_id for w in ready
                       if w.worker_id not in held and num_free[w.worker_id] >= request.num_blocks), None)
        if target is not None:
            placements[request.request_id] = target
            num_free[target] -= request.num_blocks
        elif _is_starved(request, now_s, max_wait_s):
            holdable = [w for w in ready if w.worker_id not in held and w.num_total_blocks >= request.num_blocks]
            if holdable:
                held.add(min(holdable, key=lambda w: (-num_free[w.worker_id], w.worker_id)).worker_id)
    return placements


def migration_target(num_blocks: int, workers: Sequence[WorkerBudget], exclude_worker_id: str) -> str | None:
    """Where an overrunning sequence of `num_blocks` should move: the ready worker, other than
    `exclude_worker_id`, with the most free blocks (ties by worker id) if it fits, else None."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    candidates = [w for w in workers
                  if w.is_ready and w.worker_id != exclude_worker_id and w.num_free_blocks >= num_blocks]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (-w.num_free_blocks, w.worker_id)).worker_id


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """How many workers the pool should run, decided from demand.

    Hysteresis: the pool grows as soon as demand exceeds what it can take, but shrinks only
    after nothing was pending for `scale_down_idle_s` and a whole worker's worth of blocks is
    free, so a brief lull between bursts does not tear down a worker that is needed again.

    Attributes:
        min_workers: floor of the pool.
        max_workers: ceiling of the pool.
        scale_up_queue_depth: pending requests per worker above which a worker is added.
        scale_down_idle_s: seconds with nothing pending before one worker is removed.
        max_scale_up_step: most workers added by one decision (starting workers is slow and
            asks for GPUs; a bounded step keeps a spike from over-provisioning).
    """

    min_workers: int
    max_workers: int
    scale_up_queue_depth: int = 4
    scale_down_idle_s: float = 60.0
    max_scale_up_step: int = 1

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise ValueError(f"min_workers must be >= 0, got {self.min_workers}")
        if self.max_workers < max(1, self.min_workers):
            raise ValueError(f"max_workers must be >= max(1, min_workers={self.min_workers}), got {self.max_workers}")
        if self.scale_up_queue_depth < 1:
            raise ValueError(f"scale_up_queue_depth must be >= 1, got {self.scale_up_queue_depth}")
        if self.scale_down_idle_s < 0:
            raise ValueError(f"scale_down_idle_s must be >= 0, got {self.scale_down_idle_s}")
        if self.max_scale_up_step < 1:
            raise ValueError(f"max_scale_up_step must be >= 1, got {self.max_scale_up_step}")

    def desired_num_workers(self, num_workers: int, num_pending: int, num_pending_blocks: int,
                            num_free_blocks_total: int, blocks_per_worker: int, idle_s: float) -> int:
        """The pool size to aim for after this decision.

        Args:
            num_workers: workers running or starting now.
            num_pending: requests waiting for placement.
            num_pending_blocks: sum of their reservations, in blocks.
            num_free_blocks_total: free blocks over all ready workers.
            blocks_per_worker: KV blocks of one worker.
            idle_s: seconds since a request was last pending (0 while some are).

        Returns:
            `num_workers` moved by at most `max_scale_up_step` up or one down, then clamped to
            [min_workers, max_workers] (a pool outside the bounds goes straight to them).
        """
        for name, value in (("num_workers", num_workers), ("num_pending", num_pending),
                            ("num_pending_blocks", num_pending_blocks),
                            ("num_free_blocks_total", num_free_blocks_total), ("idle_s", idle_s)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if blocks_per_worker < 1:
            raise ValueError(f"blocks_per_worker must be >= 1, got {blocks_per_worker}")

        # Workers needed so that each holds at most scale_up_queue_depth pending requests, and
        # workers needed on top of today's free room for the predicted blocks of the queue.
        needed_for_queue = math.ceil(num_pending / self.scale_up_queue_depth)
        missing_blocks = num_pending_blocks - num_free_blocks_total
        needed_for_blocks = num_workers + math.ceil(missing_blocks / blocks_per_worker) if missing_blocks > 0 else 0
        wanted = max(needed_for_queue, needed_for_blocks)
        if num_pending > 0 and wanted > num_workers:
            desired = min(wanted, num_workers + self.max_scale_up_step)
        elif (num_pending == 0 and idle_s >= self.scale_down_idle_s
              and num_free_blocks_total >= blocks_per_worker and num_workers > 0):
            desired = num_workers - 1
        else:
            desired = num_workers
        return min(self.max_workers, max(self.min_workers, desired))


def _placement_order(pending: Sequence[PendingRequest], now_s: float | None,
                     max_wait_s: float) -> list[PendingRequest]:
    starved = sorted((r for r in pending if _is_starved(r, now_s, max_wait_s)),
                     key=lambda r: (r.arrival_s, r.request_id))
    fresh = sorted((r for r in pending if not _is_starved(r, now_s, max_wait_s)),
                   key=lambda r: (-r.num_blocks, r.arrival_s, r.request_id))
    return starved + fresh


def _is_starved(request: PendingRequest, now_s: float | None, max_wait_s: float) -> bool:
    return now_s is not None and now_s - request.arrival_s >= max_wait_s


def _check_unique(ids: list[str], what: str) -> None:
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate {what}s: {duplicates}")
