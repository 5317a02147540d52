"""Load rebalancing: move one live request from the busiest worker to the idlest.

Placement binds a request to a worker when it arrives, by what the policy plans for it;
how long it will really run is only predicted. When predictions err, or a burst happens to
put the long answers on one worker, that worker ends up decoding many sequences while
another sits nearly idle, and the burst takes as long as the busier worker needs. The
controller then moves requests, with their KV, from the worker with the most live requests
(running + waiting) to the one with the fewest, one per stats round, while the idlest holds
at most `MAX_TARGET_SHARE` of the busiest's count and they differ by at least `min_gap`.
Each move narrows the gap by two, so it settles and never swings back by itself; the share
keeps a busy cluster, whose workers' counts always differ a little, from moving requests
between workers that are all busy (each move costs a KV copy and can crowd the target).

Which request moves: the donor's newest waiting one if it has any (it holds little or no
computed KV, and it would wait there while the idle worker has room), else its newest
running one (the least KV to copy). Requests already moving, already moved once by
rebalancing, or unknown to the ledger stay; the request must fit the target's free blocks.

By predicted work (`by_work`, with the service's `predicted_work` routing) the busiest and
idlest are the workers with the most and the least expected remaining tokens of their live
requests (`WorkerLoad.remaining_tokens`): two requests with 500 tokens to go outweigh four
that end within 10. It moves when the idlest's work is at most `MAX_TARGET_SHARE` of the
busiest's and the busiest has at least `min_gap` live requests, and only a request whose
remaining work is at most half the gap, so the move narrows it and never swings it the other
way, and at least `MIN_MOVE_TOKENS`, so no KV is copied for an answer about to end.

Pure: no Ray, no Redis (`ControlPlane._rebalance` applies the answer).
"""

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

MAX_TARGET_SHARE = 0.5  # move only to a worker holding at most this share of the busiest's live requests
MIN_MOVE_TOKENS = 32  # by predicted work: a request expected to end sooner is not worth a KV copy


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A ready worker as the controller sees it.

    Attributes:
        worker_id: the worker.
        request_ids: its live requests, running first, then waiting (`WorkerStats.request_ids`).
        num_running: how many of `request_ids` are running.
        num_free_blocks: blocks the controller may still plan on it.
        remaining_tokens: per request of `request_ids`, its expected remaining output tokens (empty: unknown).
    """

    worker_id: str
    request_ids: tuple[str, ...]
    num_running: int
    num_free_blocks: int
    remaining_tokens: tuple[float, ...] = ()

    @property
    def predicted_work(self) -> float:
        return float(sum(self.remaining_tokens))

    @property
    def num_live(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Move `request_id` from `source` to `target`, reserving `num_blocks` there."""

    request_id: str
    source: str
    target: str
    num_blocks: int


def check_min_gap(min_gap: int, name: str = "rebalance_min_gap") -> None:
    """ValueError naming `name` unless `min_gap` is 0 (off) or at least 2 (a gap of 1 would only swap which worker
    is busier)."""
    if min_gap < 0 or min_gap == 1:
        raise ValueError(f"{name} must be 0 (off) or at least 2 (a gap of 1 would only swap which worker is "
                         f"busier), got {min_gap}")


def choose_rebalance(loads: Sequence[WorkerLoad], blocks_of: Callable[[str], int | None], min_gap: int,
                     keep: Set[str] = frozenset(), by_work: bool = False) -> Rebalance | None:
    """The one move to make now, or None.

    Args:
        loads: ready workers.
        blocks_of: request id -> the blocks its ledger record plans (None: unknown, it stays).
        min_gap: move only when the busiest worker has at least this many more live requests than the
            idlest (and the idlest at most `MAX_TARGET_SHARE` of the busiest's); below 1, never.
        keep: requests that must not move (moving now, or moved by rebalancing before).
        by_work: compare expected remaining tokens instead of request counts (see the module docstring).

    The busiest worker: most live requests (ties: lowest id); the idlest: fewest (ties: most free
    blocks, then lowest id).
    """
    if min_gap < 1 or len(loads) < 2:
        return None
    if by_work:
        return _rebalance_work(loads, blocks_of, min_gap, keep)
    source = min(loads, key=lambda w: (-w.num_live, w.worker_id))
    target = min(loads, key=lambda w: (w.num_live, -w.num_free_blocks, w.worker_id))
    if source.num_live - target.num_live < max(min_gap, 2):  # a gap of 1 would only swap which is busier
        return None
    if target.num_live > MAX_TARGET_SHARE * source.num_live:  # both busy: not worth a KV copy
        return None
    waiting = source.request_ids[source.num_running:]
    running = source.request_ids[:source.num_running]
    for request_id in (*reversed(waiting), *reversed(running)):
        if request_id in keep:
            continue
        num_blocks = blocks_of(request_id)
        if num_blocks is not None and num_blocks <= target.num_free_blocks:
            return Rebalance(request_id, source.worker_id, target.worker_id, num_blocks)
    return None


def _rebalance_work(loads: Sequence[WorkerLoad], blocks_of: Callable[[str], int | None], min_gap: int,
                    keep: Set[str]) -> Rebalance | None:
    """`choose_rebalance` by predicted work."""
    source = min(loads, key=lambda w: (-w.predicted_work, w.worker_id))
    target = min(loads, key=lambda w: (w.predicted_work, -w.num_free_blocks, w.worker_id))
    gap = source.predicted_work - target.predicted_work
    if source.num_live < max(min_gap, 2) or gap <= 0:
        return None
    if target.predicted_work > MAX_TARGET_SHARE * source.predicted_work:  # both busy: not worth a KV copy
        return None
    remaining = dict(zip(source.request_ids, source.remaining_tokens))
    waiting = source.request_ids[source.num_running:]
    running = source.request_ids[:source.num_running]
    for request_id in (*reversed(waiting), *reversed(running)):
        if request_id in keep or not MIN_MOVE_TOKENS <= remaining.get(request_id, 0) <= gap / 2:
            continue  # about to end, or moving it would swing the imbalance the other way
        num_blocks = blocks_of(request_id)
        if num_blocks is not None and num_blocks <= target.num_free_blocks:
            return Rebalance(request_id, source.worker_id, target.worker_id, num_blocks)
    return None
