"""One simulated worker: the engine's own scheduler and allocator, stepped on a modelled clock.

`SimWorker` steps a `workers.scheduling.scheduler.Scheduler` exactly as `Engine.step` does (schedule,
swap, compute the chunks, append a token where a chunk completes a sequence's known tokens,
finish at the forced length), but instead of a forward pass a step costs
`StepModel.step_s(step_shape(chunks))` plus its swap copies. `simulate_worker` runs one alone
with every request queued at t=0, which is what `benchmarks.sim_calibration` compares with
the real engine; `benchmarks.cluster_sim` runs many under one controller.
"""

from dataclasses import dataclass, field

from benchmarks.step_time import StepModel
from cluster.config import service_default
from cluster.control.placement import DEFAULT_LATE_BINDING
from cluster.control.rebalance import check_min_gap
from cluster.control.routing import DEFAULT_ROUTING, check_routing
from workers.scheduling.engine_config import DEFAULT_MAX_QUEUE_WAIT_S
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.preemption import PreemptionCostModel, PreemptionRule
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus
from workers.values.step_output import StepShape, step_shape

SIMULATED_TOKEN = 0  # outputs are forced: their values never matter
MAX_EMPTY_STEPS = 4  # steps in a row that run no chunk before a worker counts as stuck


class _Tokens(list):
    """A prompt of `n` simulated tokens that stores none (a cluster replay holds 10^5 prompts)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [SIMULATED_TOKEN] * len(range(*index.indices(self.n)))
        if not -self.n <= index < self.n:
            raise IndexError(index)
        return SIMULATED_TOKEN

    def __iter__(self):
        return iter([SIMULATED_TOKEN] * self.n)

    def __add__(self, other):
        return [SIMULATED_TOKEN] * self.n + list(other)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the replay: its arrival, its prompt and forced output length, and its predicted bound
    (with the predictor's point estimate, when there is one: the controller plans by the estimate the
    policy chooses, as the router does)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    predicted_output_tokens: int | None = None
    point_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A simulated cluster.

    Attributes:
        num_workers: workers (one GPU each).
        num_blocks: KV blocks per worker.
        block_size: tokens per block.
        max_num_seqs, max_num_batched_tokens: each worker's engine limits.
        tick_s: how often the controller looks for preempted overruns to move.
        max_pending: requests the controller queues for room (the service's `max_pending_placements`);
            beyond it the router is refused (429) and the simulated client retries as soon as the
            queue has space, in arrival order.
        rebalance_min_gap: the service's `rebalance_min_gap` (0: no load rebalancing).
        routing: the service's `routing`: which worker with room takes a request when nobody waits.
        max_queue_wait_s: the service's `max_queue_wait_s`: seconds a request waits in the controller's queue, or
            in a worker's, before it goes ahead of every newer one.
        preemption_mode: how every policy's victims give up their KV (`CacheConfig.preemption_mode`); swapped
            copies may fill as much host memory as one worker's KV pool, beyond it they recompute.
        late_binding: the service's `late_binding`: a request waits in the controller's queue until a worker can
            start it (`placement.open_slots`); False: it goes to a worker with KV room on arrival.
    """

    num_workers: int
    num_blocks: int
    block_size: int = service_default("block_size")
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    tick_s: float = 0.5
    max_pending: int = 128
    rebalance_min_gap: int = service_default("rebalance_min_gap")
    routing: str = DEFAULT_ROUTING
    preemption_mode: str = service_default("preemption_mode")
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    late_binding: bool = DEFAULT_LATE_BINDING

    def __post_init__(self) -> None:
        for name in ("num_workers", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        check_min_gap(self.rebalance_min_gap)
        check_routing(self.routing)


@dataclass(slots=True)
class SimResult:
    """What one simulated run measured (seconds are simulated seconds unless named wall)."""

    num_requests: int = 0
    output_tokens: int = 0
    makespan_s: float = 0.0
    steady_s: float = 0.0  # until 90% of the requests finished: the drain, the longest answers alone, left out
    steady_output_tokens: int = 0  # output tokens generated by then
    latency_s: list[float] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the request of each latency, in order of finishing
    ttft_s: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_placements: int = 0
    num_refused: int = 0  # arrivals the controller's full queue refused (their clients retried)
    num_waited: int = 0  # requests that waited in the controller's queue (no worker could take them on arrival)
    controller_wait_s: float = 0.0  # their waits there, summed
    num_migrations: int = 0
    num_rebalances: int = 0  # of the migrations, moves by load rebalancing
    num_preemptions: int = 0
    num_mispredictions: int = 0
    placement_wall_s: float = 0.0  # this machine's time inside the placement functions
    num_placement_decisions: int = 0  # calls of them: roomiest, first-fit-decreasing, migration target
    simulation_wall_s: float = 0.0
    outputs_exact: bool = True
    step_samples: list[tuple] = field(default_factory=list)  # (StepShape, seconds), when asked for

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        """Tokens/s until 90% of the requests finished: capacity, without the drain of the longest answers."""
        return self.steady_output_tokens / self.steady_s if self.steady_s > 0 else 0.0


def new_sequence(request: SimRequest) -> Sequence:
    """The engine's `Sequence` for a simulated request (as `Engine.add_request` builds it)."""
    return Sequence(request.request_id, _Tokens(request.num_prompt_tokens),
                    SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                   forced_output_tokens=request.num_output_tokens),
                    arrival_s=request.arrival_s, predicted_output_tokens=request.predicted_output_tokens,
                    predicted_center_tokens=request.predicted_output_tokens)


class SimWorker:
    """One simulated worker: the engine's scheduler and allocator, stepped on the model's clock."""

    def __init__(self, worker_id: str, config: SimConfig, policy: SchedulingPolicy, step_model: StepModel):
        self.worker_id = worker_id
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        preemption = PreemptionRule(config.preemption_mode, config.num_blocks,
                                    PreemptionCostModel(kv_bytes_per_token=step_model.kv_bytes_per_token))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   max_queue_wait_s=config.max_queue_wait_s),
                                   self.allocator, policy, preemption)
        self.step_model = step_model
        self.bytes_per_block = step_model.kv_bytes_per_token * config.block_size
        self.is_busy = False
        self.is_woken = False  # a "kick" event is queued for it
        self.pending_swap_s = 0.0  # swap copies of steps that ran no chunk
        self.in_flight: list = []  # this step's chunks, applied when it ends
        self.last_shape: StepShape | None = None  # of the step in flight (or the latest)
        self.num_seen_running = 0  # running and waiting as its latest step left them (what its stats report)
        self.num_seen_waiting = 0

    def add(self, seq: Sequence) -> None:
        self.scheduler.policy.reservation_tokens(seq)  # as Engine.add_request: fail now, not mid-run
        self.scheduler.add(seq)

    def start_step(self, now_s: float) -> float | None:
        """Schedule the next step (as `Engine.step`) at simulated `now_s`; its duration, or None when nothing runs."""
        decisions = self.scheduler.schedule(now_s)
        self.num_seen_running, self.num_seen_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        swapped = sum(len(blocks) for _, blocks in decisions.swap_out + decisions.swap_in)
        self.pending_swap_s += self.step_model.swap_s(swapped * self.bytes_per_block)
        self.in_flight = decisions.chunks
        if not decisions.chunks:
            return None  # its swaps still happened: they are charged to the next step that runs
        swap_s, self.pending_swap_s = self.pending_swap_s, 0.0
        self.last_shape = step_shape(decisions.chunks)
        return self.step_model.step_s(self.last_shape) + swap_s

    def next_step(self, now_s: float) -> float | None:
        """Start the next step that runs chunks; its duration, or None when nothing is left.

        A step that only preempted is followed at once by the next, as in the engine loop; after
        `MAX_EMPTY_STEPS` of them in a row the worker is stuck, which is an error."""
        for _ in range(MAX_EMPTY_STEPS):
            if not self.scheduler.has_unfinished():
                return None
            duration_s = self.start_step(now_s)
            if duration_s is not None:
                return duration_s
        raise RuntimeError(f"worker {self.worker_id} cannot schedule any of its {len(self.scheduler.waiting)} "
                           "waiting sequences")

    def end_step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Apply the step (as `Engine.step` after the forward); (finished sequences, sequences that sampled)."""
        finished, sampled = [], []
        for chunk in self.in_flight:
            seq = chunk.seq
            samples = chunk.completes_sequence_tokens
            seq.num_computed_tokens += chunk.num_tokens
            self.scheduler.commit(seq)
            if not samples:
                continue
            seq.output_token_ids.append(SIMULATED_TOKEN)
            sampled.append(seq)
            if len(seq.output_token_ids) >= seq.params.forced_output_tokens:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
                finished.append(seq)
        self.in_flight = []
        return finished, sampled

    def preempted_overruns(self) -> list[Sequence]:
        """Waiting sequences that were preempted: what `WorkerStats.overruns` reports."""
        return [seq for seq in self.scheduler.waiting if seq.num_preemptions > 0]


def simulate_worker(requests: list[SimRequest], config: SimConfig, policy: SchedulingPolicy,
                    step_model: StepModel) -> SimResult:
    """One worker with every request queued at t=0 and no controller: what one engine alone does
    (the comparison with the real engine, `benchmarks.sim_calibration`)."""
    worker = SimWorker("w0", config, policy, step_model)
    for request in requests:
        worker.add(new_sequence(request))
    result = SimResult(num_requests=len(requests))
    expected = {r.request_id: r.num_output_tokens for r in requests}
    now_s = 0.0
    while (duration_s := worker.next_step(now_s)) is not None:
        result.step_samples.append((worker.last_shape, duration_s))
        now_s += duration_s
        finished, sampled = worker.end_step()
        result.output_tokens += len(sampled)
        for seq in finished:
            result.outputs_exact &= seq.num_output_tokens == expected[seq.seq_id]
            result.latency_s.append(now_s)
    stats = worker.scheduler.stats
    result.num_steps, result.num_preemptions = worker.scheduler.num_steps, stats.num_preemptions
    result.num_mispredictions, result.makespan_s = len(stats.mispredictions), now_s
    return result
