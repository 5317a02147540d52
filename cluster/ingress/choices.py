"""The sequences of one HTTP request, run together: per prompt, n choices (or best_of candidates).

Each sequence is a `GenerationJob` of its own (its own placement, length prediction and reservation). The first
of each prompt starts at once; the siblings that name it (`sibling_of`) start once it brought its first tokens:
its prompt's KV is then cached on its worker, and they are placed beside it, so they share those blocks instead
of computing the prompt again. Siblings that name none (no prefix cache to share, or a prompt each must score)
start at once. The events of all come out as one stream, tagged with the choice's index.

    leader of prompt p   --first tokens-->  start its siblings (sibling_of=leader)
    every job            --events-->  queue  -->  (index, WorkEvent), then (index, None) when it finished
"""

import asyncio
from collections.abc import AsyncIterator, Callable

from cluster.ingress.generation import GenerationJob, GenerationResult
from workers.values.work_types import WorkEvent

StartJob = Callable[[GenerationJob, GenerationResult], AsyncIterator[WorkEvent]]


class ChoiceRun:
    """Runs `groups` (per prompt, its jobs in choice order; the first is the leader) through `start`.

    `results[i]` is choice i's `GenerationResult` (choices numbered prompt by prompt). Iterate `events()` once;
    closing it (or an error in any job) stops every job still running.
    """

    def __init__(self, groups: list[list[GenerationJob]], start: StartJob) -> None:
        self.groups = groups
        self.jobs = [job for group in groups for job in group]
        self.results = [GenerationResult([]) for _ in self.jobs]
        self._start = start
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def events(self) -> AsyncIterator[tuple[int, WorkEvent | None]]:
        """(choice index, event with new tokens), and (choice index, None) once that choice finished."""
        first = 0
        for group in self.groups:
            waiting = [first + i for i, job in enumerate(group) if i and job.sibling_of is not None]
            for index in range(first, first + len(group)):
                if index not in waiting:
                    self._spawn(index, waiting if index == first else ())
            first += len(group)
        running = len(self.jobs)
        try:
            while running:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    running -= 1
                yield index, item
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, index: int, siblings=()) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(index, siblings)))

    async def _pump(self, index: int, siblings) -> None:
        """Forward one job's events to the queue; a leader starts its siblings at its first event (or its end)."""
        try:
            async for event in self._start(self.jobs[index], self.results[index]):
                self._queue.put_nowait((index, event))
                siblings = self._start_siblings(siblings)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which fails the whole request
            self._queue.put_nowait((index, error))
            return
        self._start_siblings(siblings)
        self._queue.put_nowait((index, None))

    def _start_siblings(self, siblings) -> tuple:
        for sibling in siblings:
            self._spawn(sibling)
        return ()
