"""The router's release of a request (`cluster.ingress.generation._release`), with a stand-in controller handle."""

import asyncio
import concurrent.futures
import contextvars

from ray.exceptions import TaskCancelledError

from cluster.ingress.generation import _release

REQUEST = contextvars.ContextVar("request", default=None)  # stands for Ray's own per-task context variable


class _Method:
    """`controller.finish`: records each call and the context it was submitted from; fails the first `failures`."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, str | None]] = []

    def remote(self, request_id, outcome):
        self.calls.append((request_id, REQUEST.get()))
        future = concurrent.futures.Future()
        if len(self.calls) <= self.failures:
            future.set_exception(TaskCancelledError())
        else:
            future.set_result(None)
        return type("Ref", (), {"future": lambda self: future})()


class _Controller:
    def __init__(self, failures: int = 0) -> None:
        self.finish = _Method(failures)


def test_the_release_is_no_child_of_the_request_and_a_cancelled_one_is_sent_again():
    controller = _Controller(failures=1)

    async def cancelled_request():
        REQUEST.set("the request's task")
        _release(controller, "r1", None)
        for _ in range(3):
            await asyncio.sleep(0)  # the resend is queued on the loop

    asyncio.run(cancelled_request())
    assert controller.finish.calls == [("r1", None), ("r1", None)]  # submitted outside the request's context


def test_resends_are_bounded_and_work_without_a_running_loop():
    controller = _Controller(failures=10)
    _release(controller, "r2", None)  # from a Ray thread: no event loop, resent in place
    assert len(controller.finish.calls) == 3  # the first send and two more
