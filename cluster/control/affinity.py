"""Where a request would rather be placed, when nobody waits ahead of it: beside a placed sibling of the same prompt
(one of `n` choices), else on the worker holding the longest cached prefix of its prompt (`prefix_affinity`)."""

from collections.abc import Mapping

from cluster.control.ledger import Ledger
from cluster.control.placement import RoomIndex, prefix_affinity
from workers.values.work_types import WorkerStats


class Affinity:
    """Reads the ledger (where siblings are), the rooms (free blocks) and the workers' latest stats (their
    cached prefix hashes, kept as sets rebuilt once per report)."""

    def __init__(self, ledger: Ledger, rooms: RoomIndex, latest: Mapping[str, WorkerStats]) -> None:
        self._ledger = ledger
        self._rooms = rooms
        self._latest = latest
        self._prefix_sets: dict[str, tuple[WorkerStats, frozenset[int]]] = {}

    def target(self, sibling_of: str | None, prefix_hashes: tuple[int, ...], num_blocks: int,
               exclude: str | None) -> str | None:
        """The preferred worker with room for `num_blocks`, or None to route as usual."""
        return self._sibling(sibling_of, num_blocks, exclude) or self._prefix(prefix_hashes, num_blocks, exclude)

    def forget(self, worker_id: str) -> None:
        self._prefix_sets.pop(worker_id, None)

    def _sibling(self, sibling_of: str | None, num_blocks: int, exclude: str | None) -> str | None:
        record = self._ledger.get(sibling_of) if sibling_of is not None else None
        if record is None or record.state != "placed" or record.worker_id == exclude:
            return None
        return record.worker_id if self._rooms.free().get(record.worker_id, 0) >= num_blocks else None

    def _prefix(self, prefix_hashes: tuple[int, ...], num_blocks: int, exclude: str | None) -> str | None:
        """O(workers): only for requests that carry hashes."""
        if not prefix_hashes:
            return None
        free = {w: f for w, f in self._rooms.free().items() if w != exclude}
        total, cached = {}, {}
        for worker_id in list(free):
            stats = self._latest.get(worker_id)
            if stats is None:
                del free[worker_id]
                continue
            total[worker_id] = stats.num_total_blocks
            known = self._prefix_sets.get(worker_id)
            if known is None or known[0] is not stats:  # rebuilt once per stats report
                known = self._prefix_sets[worker_id] = (stats, frozenset(stats.prefix_hashes))
            cached[worker_id] = known[1]
        return prefix_affinity(prefix_hashes, num_blocks, free, total, cached)
