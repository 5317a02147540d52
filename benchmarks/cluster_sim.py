"""A discrete-event simulation of a whole S3 Serve cluster: the real decisions, a modelled clock.

Nothing here re-implements a decision. Every worker is a `benchmarks.sim_worker.SimWorker`: the
engine's own `Scheduler` over its own `BlockAllocator` with the policy `make_policy` builds,
stepped exactly as `Engine.step` steps it; the controller places with `placement.RoomIndex.roomiest`
and `first_fit_decreasing` by the policy's `placement_tokens`, holding back what no worker can start yet
(`placement.open_slots`, with late binding), moves preempted overruns with `migration_target` and
rebalances load with `choose_rebalance`, as `ControlPlane.place`, `ControlPlane._move_overruns` and
`ControlPlane._rebalance` do. What is modelled is only time: a
step takes `StepModel.step_s` of its `StepShape` (plus swap copies), instead of running a
forward pass. Outputs are forced to the trace's lengths, as in `bench policies`.

Simplifications (`SIMPLIFICATIONS`, printed with every report): the controller sees each worker's reservations as of
its latest finished step (the service: as of its latest stats poll, every `tick_s`); a request
reaches its worker the moment it is placed (no RPC latency); a moved request carries its KV
(charged as a swap-in at `StepModel.swap_s`); no prefix caching (the Azure traces carry no
prefix ids); no worker failures. A rebalancing move is applied when the source's step in flight
ends, as the service's worker applies it between two steps.
"""

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import replace

from benchmarks.sim_worker import SimConfig, SimRequest, SimResult, SimWorker, new_sequence
from benchmarks.step_time import StepModel
from cluster.control.placement import (WORKER_QUEUE_SEQS, PendingRequest, RoomIndex, WorkerBudget, blocks_for,
                                       chooses_by_work, first_fit_decreasing, migration_target, open_slots)
from cluster.control.rebalance import Rebalance, WorkerLoad, choose_rebalance
from cluster.control.routing import LENGTHS, LeastWorkChooser, LiveWork, route
from workers.values.sequence import Sequence

STEADY_FRACTION = 0.9  # the steady rate counts until this share of the requests has finished
MAX_IDLE_TICKS = 1000  # ticks in a row with nothing running before the run is declared stalled
SIMPLIFICATIONS = ("the controller sees each worker's reservations as of its latest step; no RPC latency; a moved "
                   "request carries its KV (charged as a host copy); no prefix caching; no failures")


class ClusterSimulation:
    """Replays requests through `num_workers` simulated workers and one controller.

    Args:
        config: the cluster.
        make_policy: builds one policy instance (each worker gets its own; the controller one more, of which it
            asks only the planning rule, as the real controller does).
        step_model: the clock.
        record_steps: keep every step's (shape, seconds) in the result (calibration checks).
    """

    def __init__(self, config: SimConfig, make_policy, step_model: StepModel, record_steps: bool = False):
        self.config = config
        self.policy = make_policy()
        self.workers = {f"w{i}": SimWorker(f"w{i}", config, make_policy(), step_model)
                        for i in range(config.num_workers)}
        self.record_steps = record_steps
        self.rooms = RoomIndex()
        for worker_id in self.workers:
            self.rooms.set(worker_id, config.num_blocks)
        self.ledger: dict[str, tuple[str, int]] = {}  # request id -> (worker id, reserved blocks)
        self.reserved: dict[str, int] = dict.fromkeys(self.workers, 0)
        self.num_placed: dict[str, int] = dict.fromkeys(self.workers, 0)  # requests the ledger places there
        self.waiting: dict[str, tuple[PendingRequest, SimRequest, Sequence]] = {}
        self.backlog: deque[tuple[SimRequest, int, Sequence]] = deque()  # refused: clients retrying
        self.pending_move: Rebalance | None = None  # chosen, applied when its source's step ends
        self.rebalanced: set[str] = set()  # moved by rebalancing once: they stay
        self._num_live = 0  # queued events other than ticks: while none is left, only a tick can make progress
        self._events: list = []
        self._order = itertools.count()
        self.result = SimResult()
        self._work: dict[str, tuple[tuple[int, int, int], LiveWork]] = {}  # worker -> (when built, its live work)

    # -- the event loop ---------------------------------------------------------------

    def run(self, requests: list[SimRequest], progress=None) -> SimResult:
        result = self.result
        result.num_requests = len(requests)
        expected = {r.request_id: r.num_output_tokens for r in requests}
        arrivals = {r.request_id: r.arrival_s for r in requests}
        first_token: dict[str, float] = {}
        steady_done = math.ceil(STEADY_FRACTION * len(requests))  # the steady span ends as this many have finished
        start_wall_s = time.perf_counter()
        for request in requests:
            self._push(request.arrival_s, "arrive", request)
        self._push(self.config.tick_s, "tick", None)
        num_done, now_s, idle_ticks = 0, 0.0, 0
        while num_done < len(requests):
            now_s, _, kind, payload = heapq.heappop(self._events)
            if kind != "tick":
                self._num_live -= 1
                idle_ticks = 0
            elif self._num_live == 0:
                idle_ticks += 1
                if idle_ticks > MAX_IDLE_TICKS:
                    raise RuntimeError(f"simulation stalled: {num_done} of {len(requests)} requests finished, "
                                       f"nothing runs and {len(self.waiting) + len(self.backlog)} wait")
            if kind == "arrive":
                self._place(payload, now_s)
            elif kind == "kick":
                self.workers[payload].is_woken = False
                self._kick(self.workers[payload], now_s)
            elif kind == "tick":  # as ControlPlane.tick: move overruns, rebalance, then place what waits and fits
                self._move_overruns(now_s)
                self._rebalance(now_s)
                self._place_waiting(now_s)
                self._push(now_s + self.config.tick_s, "tick", None)
            else:  # "step": a worker's step ends now
                worker = self.workers[payload]
                finished, sampled = worker.end_step()
                result.output_tokens += len(sampled)
                for seq in sampled:
                    first_token.setdefault(seq.seq_id, now_s)
                for seq in finished:
                    num_done += 1
                    if num_done == steady_done:
                        result.steady_s = now_s - min(arrivals.values())
                        result.steady_output_tokens = result.output_tokens
                    result.outputs_exact &= seq.num_output_tokens == expected[seq.seq_id]
                    result.latency_s.append(now_s - arrivals[seq.seq_id])
                    result.finished_ids.append(seq.seq_id)
                    result.ttft_s.append(first_token[seq.seq_id] - arrivals[seq.seq_id])
                    self._release(seq.seq_id, now_s)
                    if progress is not None:
                        progress.update(1)
                self._refresh_room(payload)
                worker.is_busy = False
                if self.pending_move is not None and self.pending_move.source == payload:
                    self._apply_rebalance(now_s)
                self._kick(worker, now_s)
        result.makespan_s = now_s - min(arrivals.values())
        for worker in self.workers.values():
            stats = worker.scheduler.stats
            result.num_preemptions += stats.num_preemptions
            result.num_mispredictions += len(stats.mispredictions)
            result.num_steps += worker.scheduler.num_steps
        result.simulation_wall_s = time.perf_counter() - start_wall_s
        return result

    def _push(self, at_s: float, kind: str, payload) -> None:
        if kind != "tick":
            self._num_live += 1
        heapq.heappush(self._events, (at_s, next(self._order), kind, payload))

    def _wake(self, worker: SimWorker, now_s: float) -> None:
        """Step an idle worker after everything else due now (requests arriving together start together)."""
        if not worker.is_busy and not worker.is_woken:
            worker.is_woken = True
            self._push(now_s, "kick", worker.worker_id)

    def _kick(self, worker: SimWorker, now_s: float) -> None:
        """Start the worker's next step if it is idle and has work."""
        if worker.is_busy:
            return
        duration_s = worker.next_step(now_s)
        if duration_s is None:
            return
        if self.record_steps:
            self.result.step_samples.append((worker.last_shape, duration_s))
        worker.is_busy = True
        self._push(now_s + duration_s, "step", worker.worker_id)

    # -- the controller ----------------------------------------------------------------

    def _decided(self, started_s: float) -> None:
        """Count one call of a placement function and the host time it took."""
        self.result.placement_wall_s += time.perf_counter() - started_s
        self.result.num_placement_decisions += 1

    def _plan_blocks(self, request: SimRequest, num_output_tokens: int, bound: int | None, rule=None) -> int:
        """Blocks by the policy's `placement_tokens` (what the ledger charges), or by `rule`."""
        tokens = (rule or self.policy.placement_tokens)(request.num_prompt_tokens, num_output_tokens,
                                                        request.max_tokens, bound,
                                                        request.num_output_tokens)  # only the oracle reads the truth
        return max(1, min(blocks_for(tokens, self.config.block_size), self.config.num_blocks))

    def _place(self, request: SimRequest, now_s: float) -> None:
        """`ControlPlane.place`: the routing's worker at once when nobody waits, else queue for first-fit."""
        if request.point_output_tokens is not None and request.predicted_output_tokens is not None:
            # The router's choice: the point for on-demand policies, the upper bound for those that reserve.
            request = replace(request, point_output_tokens=None, predicted_output_tokens=self.policy.prediction_from(
                request.point_output_tokens, request.predicted_output_tokens))
        num_blocks = self._plan_blocks(request, 0, request.predicted_output_tokens)
        seq = new_sequence(request)
        started_s = time.perf_counter()
        worker_id = None if self.waiting else self._route(num_blocks, request)
        self._decided(started_s)
        if worker_id is not None:
            self._assign(request.request_id, worker_id, num_blocks, seq, now_s)
            return
        self.result.num_waited += 1
        if len(self.waiting) >= self.config.max_pending:
            self.result.num_refused += 1
            self.backlog.append((request, num_blocks, seq))
        else:
            self.waiting[request.request_id] = (self._pending(request, num_blocks, now_s), request, seq)
            self._place_waiting(now_s)

    def _pending(self, request: SimRequest, num_blocks: int, now_s: float) -> PendingRequest:
        """`ControlPlane.place`'s queue entry: ranked by predicted work under a policy whose worker admits, first
        come first served under on-demand paging."""
        return PendingRequest.under(self.policy, request.request_id, num_blocks, now_s,
                                    LENGTHS.remaining_of(request.predicted_output_tokens, 0, request.max_tokens))

    def _route(self, num_blocks: int, request: SimRequest) -> str | None:
        """`ControlPlane._route`: the configured routing among workers with room (each seen as of its latest step)."""
        if self.config.routing == "room":
            return self.rooms.roomiest(num_blocks)
        live = {worker_id: self._live_work(worker_id) for worker_id in self.workers}
        own = LENGTHS.remaining_of(request.predicted_output_tokens, 0, request.max_tokens)
        return route(self.config.routing, num_blocks, own, self.rooms.free(), live)

    def _live_work(self, worker_id: str) -> LiveWork:
        """A worker's `LiveWork` as of its latest step, rebuilt when a step starts (`num_steps`) or a request
        comes, goes or moves (`_assign`, `_release` and `_move` drop it)."""
        worker = self.workers[worker_id]
        key = (worker.scheduler.num_steps, len(worker.scheduler.running), len(worker.scheduler.waiting))
        cached = self._work.get(worker_id)
        if cached is None or cached[0] != key:
            sequences = (*worker.scheduler.running, *worker.scheduler.waiting)
            cached = self._work[worker_id] = (key, LiveWork(
                LENGTHS.remaining_of(s.length_center_tokens, s.num_output_tokens, s.params.max_tokens)
                for s in sequences))
        return cached[1]

    def _place_waiting(self, now_s: float) -> None:
        """First-fit-decreasing over the queue, when some worker could take its smallest request."""
        while self.backlog and len(self.waiting) < self.config.max_pending:  # retried requests join the queue
            request, num_blocks, seq = self.backlog.popleft()
            self.waiting[request.request_id] = (self._pending(request, num_blocks, now_s), request, seq)
        if not self.waiting:
            return
        started_s = time.perf_counter()
        smallest = min(p.num_blocks for p, _, _ in self.waiting.values())
        if self.rooms.roomiest(smallest) is not None:
            # Workers too full for even the smallest request cannot take any; leaving them out saves work.
            budgets = self._budgets(smallest)
            choose = (LeastWorkChooser({b.worker_id: self._live_work(b.worker_id) for b in budgets})
                      if chooses_by_work(self.config.late_binding, self.config.routing) else None)
            chosen = first_fit_decreasing([p for p, _, _ in self.waiting.values()], budgets, now_s=now_s,
                                          max_wait_s=self.config.max_queue_wait_s, choose=choose)
        else:
            chosen = {}
        self._decided(started_s)
        for request_id, worker_id in chosen.items():
            pending, _, seq = self.waiting.pop(request_id)
            self.result.controller_wait_s += now_s - seq.arrival_s  # from arrival: a refused one waited too
            self._assign(request_id, worker_id, pending.num_blocks, seq, now_s)
        if chosen and self.backlog:
            self._place_waiting(now_s)

    def _budgets(self, min_free_blocks: int = 0) -> list[WorkerBudget]:
        budgets = (WorkerBudget(w, self.config.num_blocks, self._held(w), num_open_slots=self._open_slots(w))
                   for w in self.workers)
        return [b for b in budgets if b.num_free_blocks >= min_free_blocks]

    def _open_slots(self, worker_id: str) -> int | None:
        """`WorkerRooms.open_slots`, from the worker's queues as its latest step's admission left them."""
        worker = self.workers[worker_id]
        return open_slots(self.config.max_num_seqs, WORKER_QUEUE_SEQS if self.config.late_binding else None,
                          worker.num_seen_running, worker.num_seen_waiting, self.num_placed[worker_id])

    def _held(self, worker_id: str) -> int:
        """As `WorkerRooms.refresh`: the ledger's reservations or the worker's own, whichever is more."""
        return max(self.reserved[worker_id], self.workers[worker_id].allocator.num_reserved_blocks)

    def _assign(self, request_id: str, worker_id: str, num_blocks: int, seq: Sequence, now_s: float) -> None:
        self._work.pop(worker_id, None)  # its live work changed
        self.result.num_placements += 1
        self.ledger[request_id] = (worker_id, num_blocks)
        self.reserved[worker_id] += num_blocks
        self.num_placed[worker_id] += 1
        self._refresh_room(worker_id)
        worker = self.workers[worker_id]
        seq.queued_s = now_s  # the worker's starvation bound counts from here, as a worker's from its add_request
        worker.add(seq)
        self._wake(worker, now_s)

    def _refresh_room(self, worker_id: str) -> None:
        is_open = self._open_slots(worker_id) != 0
        self.rooms.set(worker_id, max(0, self.config.num_blocks - self._held(worker_id)) if is_open else 0)

    def _release(self, request_id: str, now_s: float) -> None:
        worker_id, num_blocks = self.ledger.pop(request_id)
        self._work.pop(worker_id, None)
        self.rebalanced.discard(request_id)
        self.reserved[worker_id] -= num_blocks
        self.num_placed[worker_id] -= 1
        self._refresh_room(worker_id)
        self._place_waiting(now_s)

    def _move_overruns(self, now_s: float) -> None:
        """`Mover.move_overruns`: a preempted overrun moves where the plan of its next bound fits."""
        for worker_id, worker in self.workers.items():
            for seq in worker.preempted_overruns():
                if seq.num_output_tokens >= seq.params.max_tokens:
                    continue
                request = SimRequest(seq.seq_id, seq.arrival_s, seq.num_prompt_tokens,
                                     seq.params.forced_output_tokens, seq.params.max_tokens)
                plan_blocks = self._plan_blocks(request, seq.num_output_tokens, seq.predicted_output_tokens,
                                                self.policy.planned_tokens)
                started_s = time.perf_counter()
                target = migration_target(plan_blocks, self._budgets(plan_blocks), exclude_worker_id=worker_id)
                self._decided(started_s)
                if target is None:
                    continue
                num_blocks = self._plan_blocks(request, seq.num_output_tokens, seq.predicted_output_tokens)
                self._move(seq, worker, target, num_blocks, now_s)

    def _rebalance(self, now_s: float) -> None:
        """`ControlPlane._rebalance`: one live request from the busiest worker to the idlest, once no move is
        in flight; applied now if its source is between steps, else when its step ends."""
        if self.config.rebalance_min_gap < 1 or self.pending_move is not None:
            return
        by_work = self.config.routing == "predicted_work"
        live = {w: len(worker.scheduler.running) + len(worker.scheduler.waiting) for w, worker in self.workers.items()}
        if not by_work and max(live.values()) - min(live.values()) < max(2, self.config.rebalance_min_gap):
            return  # nothing to choose: skip building every worker's request list
        free = self.rooms.free()
        started_s = time.perf_counter()
        loads = []
        for worker_id, worker in self.workers.items():
            sequences = (*worker.scheduler.running, *worker.scheduler.waiting)
            remaining = tuple(LENGTHS.remaining_of(s.length_center_tokens, s.num_output_tokens, s.params.max_tokens)
                              for s in sequences) if by_work else ()
            loads.append(WorkerLoad(worker_id, tuple(s.seq_id for s in sequences), len(worker.scheduler.running),
                                    free.get(worker_id, 0), remaining))
        move = choose_rebalance(loads, lambda request_id: self.ledger[request_id][1] if request_id in self.ledger
                                else None, self.config.rebalance_min_gap, self.rebalanced, by_work)
        self._decided(started_s)
        if move is not None:
            self.pending_move = move
            if not self.workers[move.source].is_busy:
                self._apply_rebalance(now_s)

    def _apply_rebalance(self, now_s: float) -> None:
        move, self.pending_move = self.pending_move, None
        source = self.workers[move.source]
        seq = next((s for s in (*source.scheduler.running, *source.scheduler.waiting) if s.seq_id == move.request_id),
                   None)
        if seq is None or move.num_blocks > self.rooms.free().get(move.target, 0):
            return  # it finished in the step that just ended, or the target filled up meanwhile
        self.rebalanced.add(move.request_id)
        self.result.num_rebalances += 1
        self._move(seq, source, move.target, move.num_blocks, now_s)

    def _move(self, seq: Sequence, source: SimWorker, target_id: str, num_blocks: int, now_s: float) -> None:
        """The source drops the sequence (waiting, or between steps); the target takes it with its KV (a swap-in there).

        The target holds it at once, so the move is settled (`ControlPlane._settle_moves`) and the
        request may move again if it overruns there too."""
        self._work.pop(source.worker_id, None)
        self._work.pop(target_id, None)
        source.scheduler.finish(seq)
        _, old_blocks = self.ledger[seq.seq_id]
        self.reserved[source.worker_id] -= old_blocks
        self.num_placed[source.worker_id] -= 1
        self.ledger[seq.seq_id] = (target_id, num_blocks)
        self.reserved[target_id] += num_blocks
        self.num_placed[target_id] += 1
        moved = Sequence(seq.seq_id, seq.prompt_token_ids, seq.params, arrival_s=seq.arrival_s,
                         output_token_ids=list(seq.output_token_ids),
                         predicted_output_tokens=seq.predicted_output_tokens,
                         predicted_center_tokens=seq.predicted_center_tokens)
        if seq.num_computed_tokens > 0 or seq.is_swapped:  # as Engine.add_request with kv
            moved.num_computed_tokens = min(seq.num_computed_tokens, moved.num_tokens - 1)
            moved.is_swapped = moved.num_computed_tokens > 0
        self.result.num_migrations += 1
        self._refresh_room(source.worker_id)
        self._refresh_room(target_id)
        moved.queued_s = now_s  # as Engine.add_request on the target: its wait there starts now
        target = self.workers[target_id]
        target.add(moved)
        self._wake(target, now_s)
        self._wake(source, now_s)
