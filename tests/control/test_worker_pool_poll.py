"""The controller's stats poll tells a hung worker from a paused controller (pure asyncio: no Ray, no Redis)."""

import asyncio
import threading
import time
from types import SimpleNamespace

from cluster.control.worker_pool import WorkerPool


class Answers:
    """Workers whose answers reach the controller's loop from another thread (as Ray's replies do) `arrive_s`
    after the call; a hung one never answers."""

    def __init__(self, arrive_s: float, hung: frozenset[str] = frozenset()) -> None:
        self.arrive_s, self.hung = arrive_s, hung

    async def stats(self, handle: str):
        loop, answer = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        if handle not in self.hung:
            stats = SimpleNamespace(num_total_blocks=8)
            timer = threading.Timer(self.arrive_s, loop.call_soon_threadsafe, args=(answer.set_result, stats))
            timer.daemon = True
            timer.start()
        return await answer


def _poll(backend: Answers, pause_s: float) -> list[str]:
    async def check() -> list[str]:
        pool = WorkerPool(backend, store=None, block_size=16)
        pool.handles = {"w1": "w1", "w2": "w2"}

        async def pause() -> None:
            await asyncio.sleep(0.01)
            time.sleep(pause_s)  # the controller's loop stopped (a SIGSTOP) while the replies were on their way

        pauser = asyncio.create_task(pause())
        _, failed = await pool.poll(timeout_s=0.2)
        await pauser
        return sorted(failed)

    return asyncio.run(check())


def test_workers_whose_answers_came_while_the_controller_was_paused_are_not_taken_for_dead():
    assert _poll(Answers(arrive_s=0.55), pause_s=0.5) == []  # the deadline passed during the pause


def test_a_hung_worker_is_still_found_out():
    assert _poll(Answers(arrive_s=0.05, hung=frozenset({"w2"})), pause_s=0.0) == ["w2"]
