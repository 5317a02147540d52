"""The request ledger: every request the controller is placing or has placed, in memory, written through to Redis.

Placement reads only this memory (no Redis read on the request path). A change is
applied in memory first, so two placements interleaving on the event loop never
promise the same blocks, then written with one store call (one round trip); if the
write fails the memory is put back and the error reaches the caller (a 503 for the
router). A restarted controller rebuilds the ledger from Redis with `load()`.

    records:  request_id -> RequestRecord          (pending and placed)
    reserved: worker_id  -> sum of num_reserved_blocks of its placed requests
"""

import asyncio
from collections.abc import Callable

from cluster.control.messages import RequestRecord
from cluster.control.store import ControllerStore


class Ledger:
    """In-memory request records with write-through persistence.

    Args:
        store: where records are kept durably.
        on_change: called with a worker id whenever that worker's reserved blocks change.
    """

    def __init__(self, store: ControllerStore, on_change: Callable[[str], None] = lambda worker_id: None) -> None:
        self.store = store
        self.on_change = on_change
        self._records: dict[str, RequestRecord] = {}
        self._reserved: dict[str, int] = {}

    async def load(self) -> None:
        """Replace the memory with what Redis holds (at start-up)."""
        records = await self.store.requests()
        self._records = {}
        self._reserved = {}
        for record in records:
            self._apply(None, record)

    # -- reads ----------------------------------------------------------------------

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def records(self) -> list[RequestRecord]:
        return list(self._records.values())

    def on_worker(self, worker_id: str) -> list[RequestRecord]:
        return [r for r in self._records.values() if r.worker_id == worker_id]

    def reserved_blocks(self, worker_id: str) -> int:
        return self._reserved.get(worker_id, 0)

    def reserved_by_worker(self) -> dict[str, int]:
        return {worker_id: blocks for worker_id, blocks in self._reserved.items() if blocks}

    def __len__(self) -> int:
        return len(self._records)

    # -- changes (memory first, then one write; undone if the write fails) ---------------

    def stage(self, record: RequestRecord) -> RequestRecord | None:
        """Apply a record in memory now (before any await); returns the one it replaces, for `persist`."""
        old = self._records.get(record.request_id)
        self._apply(old, record)
        return old

    async def persist(self, record: RequestRecord, old: RequestRecord | None) -> None:
        """Write a staged record; on failure put `old` back in memory and raise."""
        try:
            await asyncio.shield(self.store.put_request(record))
        except BaseException:
            if self._records.get(record.request_id) is record:
                self._apply(record, old)
            raise

    async def put(self, record: RequestRecord) -> None:
        """Insert or replace a record (stage, then persist)."""
        await self.persist(record, self.stage(record))

    async def remove(self, request_id: str, counter: str | None = None,
                     stream: tuple[str, dict, int] | None = None) -> RequestRecord | None:
        """Delete a record (with one counter increment and one stream entry in the same round trip); returns it."""
        old = self._records.get(request_id)
        self._apply(old, None)
        try:
            await asyncio.shield(self.store.delete_request(request_id, counter=counter, stream=stream))
        except BaseException:
            self._apply(None, old)
            raise
        return old

    def _apply(self, old: RequestRecord | None, new: RequestRecord | None) -> None:
        if old is not None:
            if old.state == "placed":
                self._reserved[old.worker_id] = self._reserved.get(old.worker_id, 0) - old.num_reserved_blocks
                self.on_change(old.worker_id)
            self._records.pop(old.request_id, None)
        if new is not None:
            if new.state == "placed":
                self._reserved[new.worker_id] = self._reserved.get(new.worker_id, 0) + new.num_reserved_blocks
                self.on_change(new.worker_id)
            self._records[new.request_id] = new
