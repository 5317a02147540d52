"""What each ready worker may take now, as the controller's placement reads it: its free KV blocks, and, with late
binding, whether it may be sent another request at all (`placement.open_slots`).

A worker that may be sent nothing more shows no free blocks in the index, so every path that places by room (the
one-request fast path, affinity, rebalancing targets, scaling's free room) leaves it alone and the request waits
in the controller's queue. `budgets()` gives the queue's placement the blocks and open slots of each.
"""

from dataclasses import replace

from cluster.control.ledger import Ledger
from cluster.control.placement import WORKER_QUEUE_SEQS, RoomIndex, WorkerBudget, open_slots
from cluster.control.worker_pool import WorkerPool


class WorkerRooms(RoomIndex):
    """The room index, kept from the ledger (what the controller placed where) and the pool (the workers' latest
    stats): `refresh(worker_id)` after either changes.

    Args:
        ledger: the controller's request ledger.
        pool: the workers and their latest stats.
        max_num_seqs: the most sequences a worker runs at once.
        late_binding: hold back what no worker can start (`open_slots`); False: blocks alone decide.
    """

    def __init__(self, ledger: Ledger, pool: WorkerPool, max_num_seqs: int, late_binding: bool) -> None:
        super().__init__()
        self._ledger = ledger
        self._pool = pool
        self.configure(max_num_seqs, late_binding)

    def configure(self, max_num_seqs: int, late_binding: bool) -> None:
        """Use these settings from now on (each worker's room follows at its next refresh)."""
        self._max_num_seqs = max_num_seqs
        self._max_queue_seqs = WORKER_QUEUE_SEQS if late_binding else None

    def refresh(self, worker_id: str) -> None:
        """Set a worker's room from the ledger and its latest stats (gone or not ready: removed)."""
        stats = self._pool.latest.get(worker_id)
        if stats is None or not self._pool.is_ready(worker_id):
            self.remove(worker_id)
            return
        held = max(self._ledger.reserved_blocks(worker_id), stats.num_reserved_blocks)
        is_open = self.open_slots(worker_id) != 0
        self.set(worker_id, max(0, stats.num_total_blocks - held) if is_open else 0)

    def refresh_all(self) -> None:
        for worker_id in set(self.free()) | set(self._pool.latest):
            self.refresh(worker_id)

    def open_slots(self, worker_id: str) -> int | None:
        """How many more requests a worker with stats may be sent now (`placement.open_slots`; None: no bound)."""
        stats = self._pool.latest[worker_id]
        return open_slots(self._max_num_seqs, self._max_queue_seqs, stats.num_running, stats.num_waiting,
                          self._ledger.num_placed(worker_id))

    def budgets(self) -> list[WorkerBudget]:
        """Ready workers as the queue's placement sees them: free blocks (`WorkerPool.budgets`) and open slots."""
        return [replace(budget, num_open_slots=self.open_slots(budget.worker_id))
                for budget in self._pool.budgets(self._ledger.reserved_blocks)]
