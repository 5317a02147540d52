"""Cluster placement: which worker takes a request, and where an overrun moves.

Pure decisions over small dataclasses (no Ray, Redis or torch): the controller builds
`WorkerBudget`s and `PendingRequest`s from its ledger, asks these functions, and carries out
the answer. Sizes are KV blocks throughout; `blocks_for` converts tokens.
"""

import heapq
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass

from workers.scheduling.engine_config import DEFAULT_MAX_QUEUE_WAIT_S


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
        num_open_slots: how many more requests it may be sent now (`open_slots`); None: no bound.
    """

    worker_id: str
    num_total_blocks: int
    num_reserved_blocks: int
    is_ready: bool = True
    num_open_slots: int | None = None

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
        num_blocks: its reservation (the policy's `placement_tokens`, e.g. prompt + predicted upper bound for
            s3), in blocks.
        arrival_s: when it started waiting (any clock, as long as `now_s` uses the same one).
        priority: its class, lower is more urgent: placed before every less urgent request.
        work_tokens: its predicted remaining output tokens, when the policy ranks by them (one whose
            worker admits by its own test, so its reservation says nothing of how long it runs):
            within a class it is then placed shortest predicted work first, not largest reservation first.
        first_come: placed in order of arrival within its class (on-demand paging ranks nothing: vLLM's order),
            first fit: a later one that fits may pass one that does not yet; `work_tokens` then only chooses
            its worker.
    """

    request_id: str
    num_blocks: int
    arrival_s: float
    priority: int = 0
    work_tokens: float | None = None
    first_come: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"request {self.request_id!r}: num_blocks must be >= 1, got {self.num_blocks}")

    @classmethod
    def under(cls, rule, request_id: str, num_blocks: int, arrival_s: float, expected_work_tokens: float,
              priority: int = 0) -> "PendingRequest":
        """The queue entry of a request under a planning rule (`rule.admits_at_worker`, `rule.holds_plan`): where
        the worker admits by its own test (s3_peak) only the prompt is charged, so the queue ranks by predicted
        work; on-demand paging ranks nothing, its queue is first come, first served (vLLM's); otherwise largest
        reservation first. The controller and the simulator queue by this one rule."""
        return cls(request_id, num_blocks, arrival_s, priority,
                   expected_work_tokens if rule.admits_at_worker else None,
                   first_come=not rule.holds_plan and not rule.admits_at_worker)


def chooses_by_work(late_binding: bool, routing: str) -> bool:
    """Whether a queued request goes where it is predicted to finish soonest (`routing.LeastWorkChooser`): only with
    late binding under predicted-work routing; otherwise first fit on the roomiest worker, as before late binding."""
    return late_binding and routing == "predicted_work"


#: With late binding, the most requests a worker is left holding in its own queue beyond those it runs: one to
#: start at once when a sequence ends, one more for a step that frees two; the rest wait in the controller's queue.
WORKER_QUEUE_SEQS = 2
#: Whether the service binds late by default (`ServiceConfig.late_binding`; the simulator follows it). Off: on 2 CPU
#: workers (bench cluster, natural workload, 4 rounds, 2026-11-29) late binding measured 0.97x-1.10x the mean latency
#: of binding on arrival under s3_peak, and in the 64-worker simulation 1.01x (docs/benchmarks.md).
DEFAULT_LATE_BINDING = False


def open_slots(max_num_seqs: int, max_queue_seqs: int | None, num_running: int, num_waiting: int,
               num_placed: int) -> int | None:
    """How many more requests a worker may be sent now, so that what cannot start there waits in the controller's
    queue instead (late binding): the worker may hold what it runs plus `max_queue_seqs` waiting, and, while its
    latest stats show nothing waiting (no admission limit bound it then), its free slots plus those.

    Args:
        max_num_seqs: the most sequences a worker runs at once.
        max_queue_seqs: the most requests left waiting in the worker's own queue; None: no bound (None returned).
        num_running, num_waiting: from the worker's latest stats.
        num_placed: requests the ledger places there now (running, waiting there, or on their way).
    """
    if max_queue_seqs is None:
        return None
    holds = (max_num_seqs if num_waiting == 0 else min(num_running, max_num_seqs)) + max_queue_seqs
    return max(0, holds - num_placed)


def first_fit_decreasing(pending: Sequence[PendingRequest], workers: Sequence[WorkerBudget],
                         now_s: float | None = None, max_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
                         choose: Callable[[PendingRequest, list[str]], str] | None = None) -> dict[str, str]:
    """Place pending requests on workers by first-fit-decreasing of their reservations.

    Order of requests: first those *starved* (waiting at least `max_wait_s` at `now_s`),
    oldest first; then the rest, largest reservation first (or, for requests that carry
    `work_tokens`, shortest predicted work first; `first_come` ones by arrival), ties by arrival,
    then id. Both groups go class by class (`priority`, most urgent first).

    Order of workers: ready workers only, sorted once per call by free blocks at the start of
    the call (most first), ties by worker id. The order is fixed during the call, so this is
    true first fit: it packs the roomiest worker before opening the next, and since each call
    re-sorts, successive calls still spread load.

    Reservations and slots accumulate within the call, so no worker is promised more than its free
    blocks or its open slots. A request that fits nowhere is left out of the result. `choose`, when
    given, picks among the workers that fit (in the order above) instead of the first
    (`routing.LeastWorkChooser`: where the request is predicted to finish soonest).

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
    num_slots = {w.worker_id: w.num_open_slots for w in ready if w.num_open_slots is not None}
    held: set[str] = set()
    placements: dict[str, str] = {}
    for request in _placement_order(pending, now_s, max_wait_s):
        fitting = (w.worker_id for w in ready if w.worker_id not in held
                   and num_free[w.worker_id] >= request.num_blocks and num_slots.get(w.worker_id, 1) > 0)
        if choose is None:
            target = next(fitting, None)
        else:
            candidates = list(fitting)
            target = choose(request, candidates) if candidates else None
        if target is not None:
            placements[request.request_id] = target
            num_free[target] -= request.num_blocks
            if target in num_slots:
                num_slots[target] -= 1
        elif _is_starved(request, now_s, max_wait_s):
            holdable = [w for w in ready if w.worker_id not in held and w.num_total_blocks >= request.num_blocks]
            if holdable:
                held.add(min(holdable, key=lambda w: (-num_free[w.worker_id], w.worker_id)).worker_id)
    return placements


def roomiest_fit(num_blocks: int, free_blocks: Mapping[str, int]) -> str | None:
    """Where one request goes when nobody waits: what `first_fit_decreasing` picks for a single request (the
    worker with the most free blocks, ties by worker id) if it fits, else None; O(workers), no objects built.

    Args:
        num_blocks: the request's reservation.
        free_blocks: ready worker id -> free blocks.
    """
    best, best_free = None, -1
    for worker_id, free in free_blocks.items():
        if free > best_free or (free == best_free and worker_id < best):
            best, best_free = worker_id, free
    return best if best is not None and best_free >= num_blocks else None


PREFIX_MAX_LOAD_GAP = 0.25  # prefix affinity wins unless its worker's KV is this much fuller than the emptiest's


def longest_cached_prefix(prefix_hashes: Sequence[int], cached: Set[int]) -> int:
    """How many of a request's leading block hashes a worker reports as cached."""
    count = 0
    for block_hash in prefix_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def prefix_affinity(prefix_hashes: Sequence[int], num_blocks: int, free_blocks: Mapping[str, int],
                    total_blocks: Mapping[str, int], cached: Mapping[str, Set[int]],
                    max_load_gap: float = PREFIX_MAX_LOAD_GAP) -> str | None:
    """The worker holding the longest cached prefix of a request, if that is not much more loaded.

    Among ready workers with `num_blocks` free, take the one whose reported cache holds the most
    leading blocks of the request (ties: most free blocks, then worker id). It wins unless its
    load (reserved / total blocks) exceeds the least loaded candidate's by more than
    `max_load_gap`: then, and when no worker holds any of the prefix, the answer is None and the
    caller places by room as usual (`roomiest_fit`).

    Args:
        prefix_hashes: the request's chained block hashes (`workers.scheduling.prefix_cache.block_hashes`).
        num_blocks: its reservation.
        free_blocks: free blocks per ready worker.
        total_blocks: total blocks per worker.
        cached: prefix hashes each worker reported.
        max_load_gap: the documented threshold, a share of a worker's blocks.
    """
    candidates = [w for w, free in free_blocks.items() if free >= num_blocks and total_blocks.get(w, 0) > 0]
    if not prefix_hashes or not candidates:
        return None

    def load(worker_id: str) -> float:
        return 1.0 - free_blocks[worker_id] / total_blocks[worker_id]

    # max() keeps the first of equals: sorted ids make the lower id win a tie.
    best = max(sorted(candidates), key=lambda w: (longest_cached_prefix(prefix_hashes, cached.get(w, frozenset())),
                                                  free_blocks[w]))
    if longest_cached_prefix(prefix_hashes, cached.get(best, frozenset())) == 0:
        return None
    if load(best) - min(load(w) for w in candidates) > max_load_gap:
        return None
    return best


class RoomIndex:
    """Free KV blocks per ready worker, kept up to date change by change, answering `roomiest_fit` in
    O(log workers): a max-heap of (free blocks, worker id) whose stale entries are skipped when read.

    The controller sets a worker's count whenever its reservations or stats change, and removes
    workers that stop being ready; `roomiest(n)` is `roomiest_fit(n, self.free())` (tested).
    """

    def __init__(self) -> None:
        self._free: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []  # (-free, worker_id); an entry is live if it matches _free

    def set(self, worker_id: str, free_blocks: int) -> None:
        if self._free.get(worker_id) == free_blocks:
            return
        self._free[worker_id] = free_blocks
        heapq.heappush(self._heap, (-free_blocks, worker_id))
        if len(self._heap) > 4 * len(self._free) + 64:  # drop stale entries now and then
            self._heap = [(-free, wid) for wid, free in self._free.items()]
            heapq.heapify(self._heap)

    def remove(self, worker_id: str) -> None:
        self._free.pop(worker_id, None)

    def free(self) -> dict[str, int]:
        return dict(self._free)

    def roomiest(self, num_blocks: int, exclude: str | None = None) -> str | None:
        """The ready worker with the most free blocks (ties by id), if it fits `num_blocks`; else None."""
        if exclude is not None:
            return roomiest_fit(num_blocks, {w: f for w, f in self._free.items() if w != exclude})
        heap = self._heap
        while heap:
            negative_free, worker_id = heap[0]
            if self._free.get(worker_id) == -negative_free:
                return worker_id if -negative_free >= num_blocks else None
            heapq.heappop(heap)  # stale: the worker's count changed or it left
        return None


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


def _placement_order(pending: Sequence[PendingRequest], now_s: float | None,
                     max_wait_s: float) -> list[PendingRequest]:
    starved = sorted((r for r in pending if _is_starved(r, now_s, max_wait_s)),
                     key=lambda r: (r.priority, r.arrival_s, r.request_id))
    fresh = sorted((r for r in pending if not _is_starved(r, now_s, max_wait_s)),
                   key=lambda r: (r.priority, _rank(r), r.arrival_s, r.request_id))
    return starved + fresh


def _rank(request: PendingRequest) -> float:
    if request.first_come:
        return 0.0
    return -request.num_blocks if request.work_tokens is None else request.work_tokens


def _is_starved(request: PendingRequest, now_s: float | None, max_wait_s: float) -> bool:
    return now_s is not None and now_s - request.arrival_s >= max_wait_s


def _check_unique(ids: list[str], what: str) -> None:
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate {what}s: {duplicates}")
