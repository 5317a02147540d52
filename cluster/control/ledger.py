"""The request ledger: every request the controller is placing or has placed, in memory, written through to Redis.

Placement reads only this memory (no Redis read on the request path). A change is
applied in memory first, so two placements interleaving on the event loop never
promise the same blocks, then written with one store call (one round trip); if the
write fails the memory is put back and the error reaches the caller (a 503 for the
router). A release is the exception: a request that finished is gone whatever Redis
says, so a release that cannot be written stays done in memory and is queued; `sync()`
writes the queue and then makes Redis equal to memory (after Redis came back, possibly
restarted without its last second of writes). A restarted controller rebuilds the ledger
from Redis with `load()`.

    records:  request_id -> RequestRecord          (pending and placed)
    reserved: worker_id  -> sum of num_reserved_blocks of its placed requests
    placed:   worker_id  -> how many requests are placed there
"""

import asyncio
import logging
from collections.abc import Callable

import redis

from cluster.control.messages import RequestRecord
from cluster.control.store import ControllerStore

logger = logging.getLogger(__name__)

# Errors that mean "Redis is not there right now" (restarting, loading, unreachable); others are answers.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


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
        self._placed: dict[str, int] = {}
        self._unwritten_removals: dict[str, tuple[str | None, tuple | None]] = {}  # id -> (counter, stream)
        self.needs_sync = False  # a write failed: Redis may differ from memory until `sync()`

    async def load(self) -> None:
        """Replace the memory with what Redis holds (at start-up)."""
        records = await self.store.requests()
        self._records = {}
        self._reserved = {}
        self._placed = {}
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

    def num_placed(self, worker_id: str) -> int:
        """Requests placed on `worker_id` (running, waiting there, or on their way)."""
        return self._placed.get(worker_id, 0)

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
            self.needs_sync = True  # the write may have reached Redis before the error
            if self._records.get(record.request_id) is record:
                self._apply(record, old)
            raise

    async def put(self, record: RequestRecord) -> None:
        """Insert or replace a record (stage, then persist)."""
        await self.persist(record, self.stage(record))

    async def remove(self, request_id: str, counter: str | None = None,
                     stream: tuple[str, dict, int] | None = None) -> RequestRecord | None:
        """Delete a record (with one counter increment and one stream entry in the same round trip); returns it.

        With Redis unreachable the record stays deleted in memory (its blocks are free for placement)
        and the write waits for `sync()`.
        """
        old = self._records.get(request_id)
        self._apply(old, None)
        try:
            await asyncio.shield(self.store.delete_request(request_id, counter=counter, stream=stream))
        except UNREACHABLE as error:
            logger.warning("release of %s not written (%s); queued until Redis answers", request_id,
                           type(error).__name__)
            queued = self._unwritten_removals.get(request_id)
            if queued is None or counter is not None:  # a counted release is never replaced by a plain one
                self._unwritten_removals[request_id] = (counter, stream)
            self.needs_sync = True
        except BaseException:
            self._apply(None, old)
            raise
        return old

    async def put_or_queue(self, record: RequestRecord) -> None:
        """Insert or replace a record that must change whether or not Redis answers (a requeue after a
        worker's death); with Redis unreachable the next `sync()` writes it."""
        self.stage(record)
        try:
            await asyncio.shield(self.store.put_request(record))
        except UNREACHABLE as error:
            logger.warning("record of %s not written (%s); written when Redis answers", record.request_id,
                           type(error).__name__)
            self.needs_sync = True

    @property
    def num_unwritten(self) -> int:
        """Releases done in memory and not yet in Redis."""
        return len(self._unwritten_removals)

    async def sync(self) -> tuple[int, int]:
        """Write the queued releases, then make Redis's records equal to memory; returns (removed, written).

        The queued releases carry their counter and training sample; the store counts each request
        once, so one replayed after its first try did reach Redis counts nothing more. A record that
        changes in memory while its write is in flight leaves `needs_sync` set for the next call.
        """
        self.needs_sync = False  # set again by any failure or change during the awaits below
        try:
            return await self._sync()
        except BaseException:
            self.needs_sync = True
            raise

    async def _sync(self) -> tuple[int, int]:
        for request_id, queued in list(self._unwritten_removals.items()):
            counter, stream = queued
            try:
                await self.store.delete_request(request_id, counter=counter, stream=stream)
            except redis.ResponseError as error:  # Redis answered "no": replaying it would fail forever
                logger.error("dropping the queued release of %s: %s", request_id, error)
            if self._unwritten_removals.get(request_id) is queued:
                del self._unwritten_removals[request_id]
        stored = {record.request_id: record for record in await self.store.requests()}
        num_removed = num_written = 0
        for request_id in stored.keys() - self._records.keys():
            if request_id not in self._records:  # still gone after the awaits above
                await self.store.delete_request(request_id)
                num_removed += 1
                if request_id in self._records:  # placed again while the delete was in flight
                    self.needs_sync = True
        for request_id, record in list(self._records.items()):
            if stored.get(request_id) != record and self._records.get(request_id) is record:
                await self.store.put_request(record)
                num_written += 1
                if self._records.get(request_id) is not record:  # changed or released meanwhile: write again
                    self.needs_sync = True
        self.needs_sync = self.needs_sync or bool(self._unwritten_removals)
        return num_removed, num_written

    def _apply(self, old: RequestRecord | None, new: RequestRecord | None) -> None:
        if old is not None:
            if old.state == "placed":
                self._reserved[old.worker_id] = self._reserved.get(old.worker_id, 0) - old.num_reserved_blocks
                self._placed[old.worker_id] = self._placed.get(old.worker_id, 0) - 1
                self.on_change(old.worker_id)
            self._records.pop(old.request_id, None)
        if new is not None:
            if new.state == "placed":
                self._reserved[new.worker_id] = self._reserved.get(new.worker_id, 0) + new.num_reserved_blocks
                self._placed[new.worker_id] = self._placed.get(new.worker_id, 0) + 1
                self.on_change(new.worker_id)
            self._records[new.request_id] = new
