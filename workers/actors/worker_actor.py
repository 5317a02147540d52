"""The worker as a Ray actor: a thin async shell around one `EngineLoop`.

No `@ray.remote` here: callers choose the actor options, e.g.

    handle = ray.remote(WorkerActor).options(
        name="s3-worker-w1", lifetime="detached", num_cpus=1, max_restarts=0,
    ).remote("w1", WorkerSettings.of(kv_cache_memory="256MiB"))
    await handle.ready.remote()
    async for ref in handle.generate.remote(request):   # a Ray streaming generator
        event = await ref                                # WorkEvent; the last has finish_reason set

A request the engine refuses makes the first `await ref` raise the engine's
ValueError (wrapped by Ray, still an instance of ValueError). If the actor
dies, the next `await ref` raises `ray.exceptions.RayActorError`.
"""

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import ray

from workers.actors.worker_settings import WorkerSettings
from workers.engine.device import free_memory_bytes, probe_cuda, resolve_device
from workers.engine.runtime import resolve_dtype, tune_cpu_runtime
from workers.scheduling.length_probe import LengthProbe
from workers.values.kv_memory import kv_budget_bytes, parse_kv_cache_memory
from workers.values.work_types import WorkEvent, WorkerStats, WorkRequest


def load_worker_model(settings: WorkerSettings):
    """(model, tokenizer or None for the tiny model, device): the settings' model on the device this process got."""
    from workers.engine.models import (config_dtype, load_model, load_tokenizer, make_tiny_model, resolve_model_dir,
                                resolve_tokenizer_dir)

    device = resolve_device(settings.device, *probe_cuda())
    if settings.tiny_model_seed is not None:
        model = make_tiny_model(settings.tiny_model_seed, init_std=settings.tiny_model_init_std)
        model = model.to(device, resolve_dtype(settings.dtype, device))
        return _with_served_weights(model, settings, device), None, device
    cache_dir = None if settings.model_cache_dir is None else Path(settings.model_cache_dir)
    model_dir = resolve_model_dir(settings.model, cache_dir, settings.revision)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(settings.tokenizer, model_dir, cache_dir))
    model = load_model(model_dir, dtype=resolve_dtype(settings.dtype, device, config_dtype(model_dir)), device=device)
    return _with_served_weights(model, settings, device), tokenizer, device


def _with_served_weights(model, settings: WorkerSettings, device):
    """The model with its linear weights rounded to bf16 where dtype auto means fp32 over bf16 weights (an AVX2-only
    CPU) and the fast path will read them; the Hugging Face stack (tensor parallel, other models) keeps fp32."""
    from workers.engine.fast_decoder import unsupported_reason
    from workers.engine.linear_weights import reads_bf16_weights, round_linear_weights_to_bf16

    engine = settings.engine
    if (reads_bf16_weights(settings.dtype, device) and engine.use_fast_path and engine.tensor_parallel_size == 1
            and unsupported_reason(model) is None):
        round_linear_weights_to_bf16(model)
    return model


def check_probe_loader(settings: WorkerSettings, load_probe) -> None:
    """ValueError when the settings name a length probe and no loader was given to build it."""
    if settings.probe is not None and load_probe is None:
        raise ValueError(f"length_probe {settings.probe!r} is set but no probe loader was given "
                         "(load_probe, e.g. cluster.control.worker_probe.load_length_probe)")


def build_engine(settings: WorkerSettings, join_ranks=None,
                 load_probe: Callable[[str, int], LengthProbe] | None = None):
    """Load the model (or build the tiny one) and wrap it in an `Engine` with the settings' policy.

    With tensor_parallel_size above 1, `join_ranks()` (from `workers.actors.rank_group.start_ranks`) makes this
    process rank 0 of the ranks once its model is loaded; torch.distributed may also run them already.
    `load_probe(settings.probe, hidden_size)` builds the length probe when the settings name one (the
    service passes `cluster.control.worker_probe.load_length_probe`: the workers import no predictor).
    """
    check_probe_loader(settings, load_probe)
    # Here, not at the top: the controller imports this module to start workers and must not load torch.
    from workers.engine.engine import Engine

    model, tokenizer, device = load_worker_model(settings)
    if join_ranks is not None:
        join_ranks()
    config = settings.engine_config(worker_kv_bytes(settings, model, device))
    probe = None if settings.probe is None else load_probe(settings.probe, model.config.hidden_size)
    return Engine(model, config, tokenizer=tokenizer, policy=settings.make_policy(), probe=probe)


def worker_kv_bytes(settings: WorkerSettings, model, device: str) -> int:
    """The KV budget of this worker's engine (per rank under tensor parallelism), sized from the memory free on its
    device now that its model is loaded."""
    from workers.engine.model_runner import pool_shape_for

    from workers.engine.linear_weights import bf16_copy_bytes

    engine = settings.engine
    pool = pool_shape_for(model.config, 1, engine.cache.block_size, model.dtype, engine.tensor_parallel_size)
    max_model_len = engine.max_model_len or model.config.max_position_embeddings
    free_bytes = free_memory_bytes(device) - bf16_copy_bytes(model)  # the fast path's copies, made after this
    return kv_budget_bytes(parse_kv_cache_memory(settings.kv_cache_memory), device, free_bytes,
                           pool.bytes_per_block // pool.block_size, max_model_len, engine.scheduler.max_num_seqs)


class WorkerActor:
    """One engine behind a Ray actor; every method is async so streams, aborts and stats interleave.

    Args:
        worker_id: this worker's id (stats and moves name it).
        settings: how to build the engine.
        rank_group: with tensor_parallel_size above 1, the placement group this actor runs in (bundle 0);
            the follower ranks take its other bundles (`workers.actors.rank_group.rank_group`).
        namespace: the Ray namespace this named actor lives in; its follower ranks are named there
            (`workers.actors.rank_group.follower_name`), so an operator can find them with `ray.get_actor`.
        load_probe: builds the length probe the settings name (`build_engine`); None when they name none.
    """

    def __init__(self, worker_id: str, settings: WorkerSettings, rank_group=None,
                 namespace: str | None = None,
                 load_probe: Callable[[str, int], LengthProbe] | None = None) -> None:
        from workers.engine.engine_loop import EngineLoop

        check_probe_loader(settings, load_probe)  # before starting any follower rank
        tune_cpu_runtime(settings.num_torch_threads)
        self.worker_id = worker_id
        self._followers, join = [], None
        if settings.engine.tensor_parallel_size > 1:
            from workers.actors.rank_group import start_ranks

            # They load their share while this actor loads its own; all join torch.distributed after.
            self._followers, join = start_ranks(settings, rank_group, load_worker_model,
                                                ray.get_runtime_context().get_actor_name(), namespace)
        self._engine = build_engine(settings, join, load_probe)
        self._loop = EngineLoop(self._engine, worker_id)
        self._closed = False
        self._rank_stall_s = settings.rank_stall_s

    async def ready(self) -> WorkerStats:
        """Answers once the engine is built (the constructor loads the model)."""
        return self._loop.stats()

    async def generate(self, request: WorkRequest) -> AsyncIterator[WorkEvent]:
        """Stream the request's events (a Ray streaming generator); ValueError for a refused request.

        A "moved" event carries its KV as an object ref (`ray.put` here): the target worker fetches
        it from this worker's object store, and the router in between holds only the ref.
        """
        # aclosing: when Ray closes this generator, the loop's generator closes now and aborts the request.
        async with contextlib.aclosing(self._loop.generate(request)) as events:
            async for event in events:
                if event.kv is not None:
                    event = replace(event, kv=ray.put(event.kv))
                yield event

    async def abort(self, request_id: str) -> bool:
        return self._loop.abort(request_id)

    async def move_out(self, request_id: str, target_worker_id: str, with_kv: bool = True) -> bool:
        return self._loop.move_out(request_id, target_worker_id, with_kv)

    async def stats(self) -> WorkerStats:
        """The engine's counters; RuntimeError once a tensor-parallel engine cannot go on (the controller,
        whose stats poll fails, then requeues this worker's requests and replaces it)."""
        failure = self._rank_failure()
        if failure is not None:
            raise RuntimeError(f"worker {self.worker_id}: {failure}; its tensor-parallel engine cannot step "
                               "again and must be replaced")
        return self._loop.stats()

    def _rank_failure(self) -> str | None:
        """Why the ranks of a tensor-parallel engine can no longer step together: a follower died, rank 0
        failed a call the followers made (`LeadRunner.broken`), or rank 0 has waited in one shared call
        longer than `rank_stall_s` (a rank hangs without dying); None otherwise, and for one rank."""
        if not self._followers or self._closed:
            return None
        from workers.actors.rank_group import ended_follower

        runner = self._engine.runner
        broken = runner.broken
        return (ended_follower(self._followers)
                or (f"rank 0 failed a call the followers made ({broken})" if broken is not None else None)
                or runner.stalled(self._rank_stall_s))

    async def close(self) -> None:
        """End every stream with "abort" and stop the step thread (before killing the actor on purpose); the
        follower ranks of a tensor-parallel engine return."""
        self._closed = True
        await self._loop.close()
        self._engine.close()
