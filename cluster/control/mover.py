"""Moving live requests between workers, for the control plane: preempted overruns and load rebalancing.

    every tick, after the stats poll:
        settle()          a move is done once its target holds the request (given up after MOVE_GIVE_UP_S)
        move_overruns()   a preempted overrun goes where the policy's plan of its next bound fits
                          (`placement.migration_target`)
        rebalance()       with no move in flight: one live request from the busiest worker to the idlest
                          (`rebalance.choose_rebalance`)

Every move reserves on the target in the ledger before the source's worker lets the request
go (`move_out`); the router then resumes it there, with its KV when the worker sent it. A move
the worker refuses puts the request's record back, unless it finished meanwhile.
"""

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from cluster.control.ledger import Ledger
from cluster.control.messages import RequestRecord
from cluster.control.placement import blocks_for, migration_target
from cluster.control.rebalance import WorkerLoad, choose_rebalance
from cluster.control.worker_pool import WorkerPool
from workers.scheduling.planning_rule import PlanningRule
from workers.values.work_types import WorkerStats

logger = logging.getLogger(__name__)

MOVE_GIVE_UP_S = 30.0  # a move whose target still lacks the request after this long (its router died) is dropped


class Mover:
    """The moves in flight and how new ones start.

    Args:
        ledger: the controller's reservations.
        pool: the workers, their handles and latest stats.
        incr: bumps one of the controller's counters ("migrations", "rebalances").
    """

    def __init__(self, ledger: Ledger, pool: WorkerPool, incr: Callable[[str], Awaitable[None]]) -> None:
        self.ledger = ledger
        self.pool = pool
        self._incr = incr
        self.moving: dict[str, str] = {}  # request id -> target worker, until the target holds it
        self._moving_since_s: dict[str, float] = {}
        self._rebalanced: set[str] = set()  # moved by rebalancing once: they stay where they went

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, or dropped by reconciling)."""
        self.moving.pop(request_id, None)
        self._moving_since_s.pop(request_id, None)
        self._rebalanced.discard(request_id)

    def settle(self) -> None:
        """A move is done once the target holds the request (it may then overrun and move again); one the
        target still lacks after MOVE_GIVE_UP_S is given up."""
        now_s = time.monotonic()
        for request_id, target in list(self.moving.items()):
            stats = self.pool.latest.get(target)
            since_s = self._moving_since_s.get(request_id, now_s)
            if stats is None or request_id in stats.request_ids or now_s - since_s > MOVE_GIVE_UP_S:
                del self.moving[request_id]
                self._moving_since_s.pop(request_id, None)

    async def move_overruns(self, policy: PlanningRule, block_size: int, migrate_kv_min_tokens: int) -> None:
        """Each preempted overrun the workers report goes where the policy's plan of its next bound fits (charged
        in the ledger by `placement_tokens`)."""
        for worker_id, stats in list(self.pool.latest.items()):
            for report in stats.overruns:
                record = self.ledger.get(report.request_id)
                if report.request_id in self.moving or record is None or record.worker_id != worker_id:
                    continue
                bound = report.predicted_output_tokens or record.predicted_output_tokens or None
                request = (report.num_prompt_tokens, report.num_output_tokens, record.max_tokens, bound)
                # The target must have room for the plan of the next bound (s3_peak's worker tests the same
                # plan, and would refuse it otherwise; sglang_ratio's charges a newcomer its whole max_tokens,
                # so there this check is looser); the ledger charges it what the policy places by.
                target = migration_target(blocks_for(policy.planned_tokens(*request), block_size),
                                          self.pool.budgets(self.ledger.reserved_blocks), exclude_worker_id=worker_id)
                if target is None:
                    continue
                num_blocks = blocks_for(policy.placement_tokens(*request), block_size)
                with_kv = report.num_prompt_tokens + report.num_output_tokens >= migrate_kv_min_tokens
                await self._move(replace(record, num_reserved_blocks=num_blocks, predicted_output_tokens=bound or 0),
                                 record, target, with_kv)

    def _load(self, worker_id: str, stats: WorkerStats, free_blocks: int, by_work: bool) -> WorkerLoad:
        """A worker's load from its stats; by work, only the requests the ledger still places there (one that
        finished, or moved and is listed by both ends until the source's next stats, counts once), and none from
        stats without one value per request."""
        if not by_work:
            return WorkerLoad(worker_id, stats.request_ids, stats.num_running, free_blocks)
        pairs = (list(zip(stats.request_ids, stats.remaining_tokens))
                 if len(stats.request_ids) == len(stats.remaining_tokens) else [])
        kept = [(index, request_id, remaining) for index, (request_id, remaining) in enumerate(pairs)
                if (record := self.ledger.get(request_id)) is not None and record.worker_id == worker_id]
        return WorkerLoad(worker_id, tuple(r for _, r, _ in kept), sum(i < stats.num_running for i, _, _ in kept),
                          free_blocks, tuple(x for _, _, x in kept))

    async def rebalance(self, min_gap: int, free_blocks: dict[str, int], by_work: bool = False) -> None:
        """One live request from the busiest worker to the idlest; only on settled stats (no move in flight),
        so that no request is counted on both sides.

        Args:
            min_gap: the service's `rebalance_min_gap` (below 1: off).
            free_blocks: ready worker -> blocks the controller may still plan on it.
            by_work: by the workers' predicted remaining work rather than their request counts.
        """
        if min_gap < 1 or self.moving:
            return
        loads = [self._load(worker_id, stats, free_blocks[worker_id], by_work)
                 for worker_id, stats in self.pool.latest.items() if worker_id in free_blocks]

        def blocks_of(request_id: str) -> int | None:
            record = self.ledger.get(request_id)
            return record.num_reserved_blocks if record is not None and record.state == "placed" else None

        # Preempted overruns are move_overruns' to place, by the bound they now need.
        keep = self._rebalanced.union(r.request_id for stats in self.pool.latest.values() for r in stats.overruns)
        move = choose_rebalance(loads, blocks_of, min_gap, keep, by_work)
        record = None if move is None else self.ledger.get(move.request_id)
        if record is None or record.worker_id != move.source:
            return
        self._rebalanced.add(move.request_id)  # before any await: forget() may come first
        # with its KV: a running request's copy beats recomputing it (a waiting one exports none, and recomputes)
        if await self._move(record, record, move.target, with_kv=True):
            await self._incr("rebalances")
        else:
            self._rebalanced.discard(move.request_id)

    async def _move(self, planned: RequestRecord, record: RequestRecord, target: str, with_kv: bool) -> bool:
        """Reserve `planned` on `target` before the router resumes the request there, then ask its worker to
        move it out; put `record` back if the worker cannot."""
        handle = self.pool.handle(record.worker_id)
        if handle is None:
            return False
        await self.ledger.put(replace(planned, worker_id=target, num_attempts=record.num_attempts + 1))
        self.moving[record.request_id] = target
        self._moving_since_s[record.request_id] = time.monotonic()
        try:
            moved = await self.pool.backend.move_out(handle, record.request_id, target, with_kv)
        except Exception:  # noqa: BLE001 - a dying source: the request stays where it is
            moved = False
        if moved:
            await self._incr("migrations")
            logger.info("moving %s from %s to %s (%s)", record.request_id, record.worker_id, target,
                        "with KV" if with_kv else "recompute")
            return True
        self.moving.pop(record.request_id, None)
        self._moving_since_s.pop(record.request_id, None)
        if self.ledger.get(record.request_id) is not None:  # the request may have finished meanwhile
            await self.ledger.put(record)
        return False
