"""Workers without a model, in-process: a `WorkerBackend` for `bench control-plane` and the control plane's tests.

Each simulated worker has a KV budget in blocks and answers like an engine: it holds the
requests it was given (their blocks), generates one token per `step_s`, reports stats,
overruns and moves. Whoever plays the router calls `generate()` after a placement:

    placement = await plane.place(...)
    await backend.generate(placement.worker_id, request_id, num_blocks, num_output_tokens)
    await plane.finish(request_id, outcome)

Faults for tests: `kill_worker` (stats fail: dead), `hang_worker` (stats never answer).
"""

import asyncio
from dataclasses import dataclass, field

from cluster.control.worker_pool import WorkerBackend
from workers.values.work_types import BoundReport, OverrunReport, WorkerStats


@dataclass(slots=True)
class SimulatedWorker:
    worker_id: str
    num_total_blocks: int
    block_size: int
    held: dict[str, int] = field(default_factory=dict)  # request id -> blocks
    overruns: list[OverrunReport] = field(default_factory=list)
    rebounded: dict[str, BoundReport] = field(default_factory=dict)  # request id -> its latest re-bound
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_overruns: int = 0
    is_alive: bool = True
    is_hung: bool = False
    prefix_hashes: tuple[int, ...] = ()  # what it reports as cached (set by tests)
    remaining: dict[str, int] = field(default_factory=dict)  # request id -> output tokens still to come

    def stats(self) -> WorkerStats:
        reserved = sum(self.held.values())
        return WorkerStats(
            worker_id=self.worker_id, num_total_blocks=self.num_total_blocks,
            num_free_blocks=max(0, self.num_total_blocks - reserved), num_used_blocks=reserved,
            num_reserved_blocks=reserved, block_size=self.block_size, bytes_per_block=0,
            num_running=len(self.held), num_waiting=len(self.overruns), num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens, num_overruns=self.num_overruns, num_preemptions=0,
            num_migrated_in=0, num_migrated_out=0, overruns=tuple(self.overruns),
            request_ids=tuple(self.held) + tuple(r.request_id for r in self.overruns),
            prefix_hashes=self.prefix_hashes, rebounded=tuple(self.rebounded.values()),
            remaining_tokens=tuple(self.remaining.get(r, 0) for r in (*self.held, *(o.request_id
                                                                                      for o in self.overruns))))


class SimulatedWorkerBackend(WorkerBackend):
    """In-process workers with `num_total_blocks` each, generating one token per `step_s`.

    Args:
        num_total_blocks: KV blocks of every worker.
        block_size: tokens per block.
        step_s: time per generated token.
        start_delay_s: how long a new worker takes to become ready.
    """

    def __init__(self, num_total_blocks: int = 256, block_size: int = 16, step_s: float = 0.0,
                 start_delay_s: float = 0.0) -> None:
        self.num_total_blocks = num_total_blocks
        self.block_size = block_size
        self.step_s = step_s
        self.start_delay_s = start_delay_s
        self.workers: dict[str, SimulatedWorker] = {}
        self.moves: list[tuple[str, str, str, bool]] = []  # (request, from, to, with_kv)
        self.location: dict[str, str] = {}  # request id -> the worker holding it (a move relocates it)

    def actor_name(self, worker_id: str) -> str:
        return f"simulated-{worker_id}"

    def start(self, worker_id: str) -> SimulatedWorker:
        worker = SimulatedWorker(worker_id, self.num_total_blocks, self.block_size)
        self.workers[worker_id] = worker
        return worker

    def find(self, worker_id: str, actor_name: str) -> SimulatedWorker | None:
        worker = self.workers.get(worker_id)
        return worker if worker is not None and worker.is_alive else None

    def kill(self, worker_id: str, handle: SimulatedWorker | None) -> None:
        if handle is not None:
            handle.is_alive = False

    async def ready(self, handle: SimulatedWorker) -> WorkerStats:
        if self.start_delay_s:
            await asyncio.sleep(self.start_delay_s)
        return await self.stats(handle)

    async def stats(self, handle: SimulatedWorker) -> WorkerStats:
        if handle.is_hung:
            await asyncio.Event().wait()  # never answers; the caller's timeout decides
        if not handle.is_alive:
            raise ConnectionError(f"simulated worker {handle.worker_id} is dead")
        return handle.stats()

    async def move_out(self, handle: SimulatedWorker, request_id: str, target_worker_id: str, with_kv: bool) -> bool:
        handle.rebounded.pop(request_id, None)
        for report in handle.overruns:
            if report.request_id == request_id:
                handle.overruns.remove(report)
                self.moves.append((request_id, handle.worker_id, target_worker_id, with_kv))
                return True
        target = self.workers.get(target_worker_id)
        if target is None or request_id not in handle.held:
            return False
        blocks = handle.held.pop(request_id)
        # a live request goes on generating where it went (the real router resumes it there)
        target.held[request_id] = blocks
        self.location[request_id] = target_worker_id
        self.moves.append((request_id, handle.worker_id, target_worker_id, with_kv))
        return True

    # -- what the simulated router calls ------------------------------------------------

    async def generate(self, worker_id: str, request_id: str, num_blocks: int, num_output_tokens: int) -> None:
        """Hold `num_blocks` while producing `num_output_tokens` tokens, one per step."""
        worker = self.workers[worker_id]
        if not worker.is_alive:
            raise ConnectionError(f"simulated worker {worker_id} is dead")
        worker.held[request_id] = num_blocks
        worker.remaining[request_id] = num_output_tokens  # it knows the truth; a real worker its expectation
        self.location[request_id] = worker_id
        try:
            if self.step_s:
                await asyncio.sleep(self.step_s * num_output_tokens)
            worker = self.workers[self.location[request_id]]
            worker.num_generated_tokens += num_output_tokens
            worker.num_steps += num_output_tokens
        finally:
            worker = self.workers[self.location.pop(request_id, worker_id)]
            worker.held.pop(request_id, None)
            worker.rebounded.pop(request_id, None)
            for each in self.workers.values():
                each.remaining.pop(request_id, None)

    def report_overrun(self, worker_id: str, request_id: str, num_prompt_tokens: int, num_output_tokens: int,
                       predicted_output_tokens: int, num_blocks_needed: int) -> None:
        """Make a worker report a held request as an overrun (preempted, waiting to move)."""
        worker = self.workers[worker_id]
        worker.held.pop(request_id, None)
        worker.num_overruns += 1
        worker.overruns.append(OverrunReport(request_id, num_prompt_tokens, num_output_tokens,
                                             predicted_output_tokens, num_blocks_needed))

    def report_bound(self, worker_id: str, request_id: str, num_output_tokens: int, predicted_output_tokens: int) -> None:
        """Make a worker report that its length probe re-bounded a request (holding the blocks it holds)."""
        worker = self.workers[worker_id]
        worker.rebounded[request_id] = BoundReport(request_id, num_output_tokens, predicted_output_tokens,
                                                   worker.held.get(request_id, 0) * worker.block_size)

    def kill_worker(self, worker_id: str) -> None:
        self.workers[worker_id].is_alive = False

    def hang_worker(self, worker_id: str, is_hung: bool = True) -> None:
        self.workers[worker_id].is_hung = is_hung
