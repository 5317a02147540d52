"""How many workers the pool should run: a pure decision from demand (no Ray, Redis or torch)."""

import math
from dataclasses import dataclass


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
