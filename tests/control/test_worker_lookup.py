"""A worker whose actor is gone is a typed `WorkerGone`, re-placed like a dead one; an engine's refusal (a
ValueError) still reaches the client. The controller and workers here are stand-ins with Ray handles' shape."""

import asyncio
import concurrent.futures

import pytest
import ray

from cluster.control.messages import Placement
from cluster.ingress.generation import GenerationJob, GenerationResult, WorkerGone, WorkerHandles, run_job
from workers.values.sampling_params import SamplingParams
from workers.values.work_types import WorkEvent

pytestmark = pytest.mark.xdist_group("ray")  # `make test`: one Ray cluster at a time


class _Ref:
    """What `.remote()` returns: awaitable, with a `future()`."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        if isinstance(self.value, BaseException):
            raise self.value
        yield from asyncio.sleep(0).__await__()
        return self.value

    def future(self) -> concurrent.futures.Future:
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


class _Method:
    def __init__(self, answer) -> None:
        self.answer, self.calls = answer, []

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        return self.answer(*args, **kwargs)


class _Controller:
    def __init__(self, workers: list[str]) -> None:
        self.place = _Method(lambda request_id, *_a, **_k: _Ref(Placement(request_id, workers.pop(0), "a", 1)))
        self.finish = _Method(lambda *_a: _Ref(None))


class _Worker:
    def __init__(self, refusal: ValueError | None = None) -> None:
        async def stream(request):
            if refusal is not None:
                raise refusal
            yield _Ref(WorkEvent(request.request_id, (7, 8), "length", num_prompt_tokens=2, num_output_tokens=2))

        self.generate = _Method(stream)
        self.abort = _Method(lambda _id: None)


class _Handles(WorkerHandles):
    def __init__(self, workers: dict) -> None:
        super().__init__()
        self.workers = workers

    def get(self, worker_id: str, actor_name: str):
        if worker_id not in self.workers:
            raise WorkerGone(f"worker {worker_id} is gone")
        return self.workers[worker_id]


def _run(controller, handles) -> GenerationResult:
    job = GenerationJob("r1", "hi", (1, 2), SamplingParams(max_tokens=2, temperature=0.0), 2, 2)
    result = GenerationResult([])

    async def drain():
        async for _ in run_job(job, controller, handles, result, lambda worker_id: worker_id):
            pass

    asyncio.run(drain())
    return result


def test_a_worker_that_is_gone_is_re_placed():
    controller = _Controller(["gone", "w2"])
    result = _run(controller, _Handles({"w2": _Worker()}))
    assert (result.output_token_ids, result.finish_reason, result.num_failovers) == ([7, 8], "length", 1)
    assert len(controller.place.calls) == 2 and controller.place.calls[1][-2] == "gone"  # told which one was lost


def test_an_engine_refusal_reaches_the_caller_and_is_not_re_placed():
    controller = _Controller(["w1", "w2"])
    with pytest.raises(ValueError, match="prompt too long"):
        _run(controller, _Handles({"w1": _Worker(ValueError("prompt too long")), "w2": _Worker()}))
    assert len(controller.place.calls) == 1


def test_a_name_no_actor_holds_is_worker_gone():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        with pytest.raises(WorkerGone, match="worker w9 .*is gone"):
            WorkerHandles().get("w9", "s3serve-worker-w9")
    finally:
        ray.shutdown()
