"""The worker as a Ray actor: a thin async shell around one `EngineLoop`.

No `@ray.remote` here: callers choose the actor options, e.g.

    handle = ray.remote(WorkerActor).options(
        name="s3-worker-w1", lifetime="detached", num_cpus=1, max_restarts=0,
    ).remote("w1", WorkerSettings(kv_cache_memory="256MiB"))
    await handle.ready.remote()
    async for ref in handle.generate.remote(request):   # a Ray streaming generator
        event = await ref                                # WorkEvent; the last has finish_reason set

A request the engine refuses makes the first `await ref` raise the engine's
ValueError (wrapped by Ray, still an instance of ValueError). If the actor
dies, the next `await ref` raises `ray.exceptions.RayActorError`.
"""

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ray

from workers.device import check_device, free_memory_bytes, probe_cuda, resolve_device
from workers.engine_config import DEFAULT_SWAP_SPACE_BYTES, EngineConfig
from workers.kv_memory import kv_budget_bytes, parse_kv_cache_memory
from workers.length_probe import LengthProbe
from workers.models import DEFAULT_MODEL
from workers.policies import DEFAULT_POLICY, POLICIES, S3Policy, make_policy
from workers.prefix_cache import prefix_cache_salt
from workers.runtime import DTYPE_CHOICES, resolve_dtype, tune_cpu_runtime
from workers.scheduling_policy import SchedulingPolicy
from workers.work_types import WorkEvent, WorkerStats, WorkRequest


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Everything needed to build a worker's engine inside the actor's process.

    Attributes:
        model: DEFAULT_MODEL (the bundled SmolLM2, converted once), a local Hugging Face folder, a GGUF file or a
            hub id in the local hub cache (`workers.models.resolve_model_dir`).
        tokenizer: where the tokenizer comes from instead (`workers.models.resolve_tokenizer_dir`); None: the model.
        revision: with a hub id: the snapshot's branch, tag or commit.
        model_cache_dir: where the converted default model is kept; None takes the user cache.
        tiny_model_seed: when set, a tiny random Llama (`make_tiny_model(seed)`) instead of `model`: fast tests.
        tiny_model_init_std: when set with tiny_model_seed, the tiny model's matrices are redrawn at this
            std, so that its tokens depend on the whole context (at its default init it echoes the last token).
        policy: scheduling policy name (`workers.policies.POLICIES`).
        bucket_tokens: s3/s3_peak length-bucket width; None: max_model_len / 10, as the controller plans.
        kv_cache_memory: the KV cache's memory: "auto", a share of the memory free once the model is loaded, or
            a size ("4GiB", bytes); sized in `build_engine` (`workers.kv_memory`). It sets the number of blocks.
        block_size: tokens per KV block.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens per forward.
        max_model_len: longest sequence; None takes the model's max_position_embeddings.
        num_torch_threads: torch intra-op threads in the actor; None takes the cores it may use.
        dtype: weights and KV element type: "auto" (bf16 on CPUs with bf16 instructions, fp32 on
            others), float32, bfloat16 or float16.
        use_fast_path: run the models it serves through the fast path (EngineConfig.use_fast_path).
        enable_prefix_caching: share and keep the KV of common prefixes (EngineConfig.enable_prefix_caching).
        device: auto (CUDA when the actor was given a GPU and torch sees one, else CPU), cpu, cuda or
            cuda:N (`workers.device`).
        length_probe: a hidden-state probe folder (`s3serve probe train`), or "default" for the shipped one:
            the engine re-bounds each sequence's output from its hidden states after prefill and every
            N decoded tokens (`workers.length_probe`); None keeps the router's bound. The actor builds it
            with the loader it is given (`WorkerActor`'s load_probe); the service's config checks the folder.
        tensor_parallel_size: processes (GPUs) the worker's engine runs over: this actor is rank 0 and starts
            the others as `FollowerRank` actors in its placement group (`workers.rank_group`); each holds 1/tp
            of the model (DeepSpeed AutoTP) and of the KV heads, so `kv_cache_memory` is per rank.
        max_overtaken_steps: under s3 and s3_peak, steps a waiting request may keep being passed by later
            ones that fit before it goes first (`EngineConfig.max_overtaken_steps`).
        rank_stall_s: with tensor_parallel_size above 1, seconds rank 0 may wait inside one call the ranks
            share (a step's forward, a KV copy) before the worker counts as hung and its stats poll fails.
        preemption_mode, swap_space_bytes: how a preempted sequence gives up its KV, under every policy alike
            (`EngineConfig`).
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    revision: str | None = None
    model_cache_dir: str | None = None
    tiny_model_seed: int | None = None
    policy: str = DEFAULT_POLICY
    kv_cache_memory: str | int = "auto"
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = 2048
    num_torch_threads: int | None = None
    tiny_model_init_std: float | None = None
    bucket_tokens: int | None = None
    dtype: str = "auto"
    use_fast_path: bool = True
    enable_prefix_caching: bool = True
    device: str = "auto"
    length_probe: str | None = None
    tensor_parallel_size: int = 1
    rank_stall_s: float = 300.0
    max_overtaken_steps: int = 1024
    preemption_mode: str = "auto"
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.num_torch_threads is not None and self.num_torch_threads < 1:
            raise ValueError(f"num_torch_threads must be >= 1 or None, got {self.num_torch_threads}")
        check_device(self.device)
        parse_kv_cache_memory(self.kv_cache_memory)
        if self.tiny_model_init_std is not None and self.tiny_model_init_std <= 0:
            raise ValueError(f"tiny_model_init_std must be > 0 or None, got {self.tiny_model_init_std}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.bucket_tokens is not None and not issubclass(POLICIES[self.policy], S3Policy):
            raise ValueError(f"bucket_tokens applies to the s3 and s3_peak policies, not {self.policy!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.rank_stall_s > 0:
            raise ValueError(f"rank_stall_s must be > 0, got {self.rank_stall_s}")
        # Fail in the caller's process, not later inside the actor.
        self.make_policy()
        self.engine_config(1)

    def engine_config(self, kv_cache_bytes: int) -> EngineConfig:
        """The engine's settings, with the KV budget sized on the worker's device (`workers.kv_memory`)."""
        return EngineConfig(
            kv_cache_bytes=kv_cache_bytes,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            use_fast_path=self.use_fast_path,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_salt=prefix_cache_salt(self.model, self.dtype),
            max_overtaken_steps=self.max_overtaken_steps,
            preemption_mode=self.preemption_mode,
            swap_space_bytes=self.swap_space_bytes,
        )

    def make_policy(self) -> SchedulingPolicy:
        """The worker's policy, built as the controller builds its own (same registry, same buckets)."""
        kwargs = {} if self.bucket_tokens is None else {"bucket_tokens": self.bucket_tokens}
        return make_policy(self.policy, max_model_len=self.max_model_len, **kwargs)


def load_worker_model(settings: WorkerSettings):
    """(model, tokenizer or None for the tiny model, device): the settings' model on the device this process got."""
    from workers.models import (config_dtype, load_model, load_tokenizer, make_tiny_model, resolve_model_dir,
                                resolve_tokenizer_dir)

    device = resolve_device(settings.device, *probe_cuda())
    if settings.tiny_model_seed is not None:
        model = make_tiny_model(settings.tiny_model_seed, init_std=settings.tiny_model_init_std)
        return model.to(device, resolve_dtype(settings.dtype, device)), None, device
    cache_dir = None if settings.model_cache_dir is None else Path(settings.model_cache_dir)
    model_dir = resolve_model_dir(settings.model, cache_dir, settings.revision)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(settings.tokenizer, model_dir, cache_dir))
    dtype = resolve_dtype(settings.dtype, device, config_dtype(model_dir))
    return load_model(model_dir, dtype=dtype, device=device), tokenizer, device


def check_probe_loader(settings: WorkerSettings, load_probe) -> None:
    """ValueError when the settings name a length probe and no loader was given to build it."""
    if settings.length_probe is not None and load_probe is None:
        raise ValueError(f"length_probe {settings.length_probe!r} is set but no probe loader was given "
                         "(load_probe, e.g. cluster.control.worker_probe.load_length_probe)")


def build_engine(settings: WorkerSettings, join_ranks=None,
                 load_probe: Callable[[str, int], LengthProbe] | None = None):
    """Load the model (or build the tiny one) and wrap it in an `Engine` with the settings' policy.

    With tensor_parallel_size above 1, `join_ranks()` (from `workers.rank_group.start_ranks`) makes this
    process rank 0 of the ranks once its model is loaded; torch.distributed may also run them already.
    `load_probe(settings.length_probe, hidden_size)` builds the length probe when the settings name one (the
    service passes `cluster.control.worker_probe.load_length_probe`: the workers import no predictor).
    """
    check_probe_loader(settings, load_probe)
    # Here, not at the top: the controller imports this module to start workers and must not load torch.
    from workers.engine import Engine

    model, tokenizer, device = load_worker_model(settings)
    if join_ranks is not None:
        join_ranks()
    config = settings.engine_config(worker_kv_bytes(settings, model, device))
    probe = None if settings.length_probe is None else load_probe(settings.length_probe, model.config.hidden_size)
    return Engine(model, config, tokenizer=tokenizer, policy=settings.make_policy(), probe=probe)


def worker_kv_bytes(settings: WorkerSettings, model, device: str) -> int:
    """The KV budget of this worker's engine (per rank under tensor parallelism), sized from the memory free on its
    device now that its model is loaded."""
    from workers.model_runner import pool_shape_for

    pool = pool_shape_for(model.config, 1, settings.block_size, model.dtype, settings.tensor_parallel_size)
    max_model_len = settings.max_model_len or model.config.max_position_embeddings
    return kv_budget_bytes(parse_kv_cache_memory(settings.kv_cache_memory), device, free_memory_bytes(device),
                           pool.bytes_per_block // pool.block_size, max_model_len, settings.max_num_seqs)


class WorkerActor:
    """One engine behind a Ray actor; every method is async so streams, aborts and stats interleave.

    Args:
        worker_id: this worker's id (stats and moves name it).
        settings: how to build the engine.
        rank_group: with tensor_parallel_size above 1, the placement group this actor runs in (bundle 0);
            the follower ranks take its other bundles (`workers.rank_group.rank_group`).
        namespace: the Ray namespace this named actor lives in; its follower ranks are named there
            (`workers.rank_group.follower_name`), so an operator can find them with `ray.get_actor`.
        load_probe: builds the length probe the settings name (`build_engine`); None when they name none.
    """

    def __init__(self, worker_id: str, settings: WorkerSettings, rank_group=None,
                 namespace: str | None = None,
                 load_probe: Callable[[str, int], LengthProbe] | None = None) -> None:
        from workers.engine_loop import EngineLoop

        check_probe_loader(settings, load_probe)  # before starting any follower rank
        tune_cpu_runtime(settings.num_torch_threads)
        self.worker_id = worker_id
        self._followers, join = [], None
        if settings.tensor_parallel_size > 1:
            from workers.rank_group import start_ranks

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
        from workers.rank_group import ended_follower

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
