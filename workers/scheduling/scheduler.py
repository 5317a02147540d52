"""The in-worker scheduler: applies a `SchedulingPolicy` to the block allocator each step.

Pure (no torch): it decides which token chunks run in the next step, which
sequences are swapped out or back in, and keeps the allocator in step with
those decisions. The engine carries them out.

Within a class, waiting sequences go in the policy's order, except that one that has waited
`max_queue_wait_s` since it last joined the queue (on the clock `schedule(now_s)` is given) goes
ahead of every newer one, and
under a first-fit policy one passed for `max_overtaken_steps` steps is passed no more, nor (with
`preempted_first`, where blocks are taken on demand) one preempted for want of KV, which goes back
before the policy's order: the blocks it freed are not handed to newcomers meanwhile. When a
waiting sequence cannot start (no slot or no room), the policy may name a running one of its
class or a less urgent one to preempt for it, because its work is much shorter
(`SchedulingPolicy.shorter_work_victim`; asked once a step, of the first one in order that cannot
start); the scheduler does it only if the waiting one then fits.

Priority classes (`Sequence.priority`, lower is more urgent) come before the policy:
waiting sequences are considered class by class (the policy's order within a class); a
victim for want of blocks is always taken from the least urgent class present (the policy's
choice within it), one for shorter work from the waiting one's class or a less urgent one, so
a sequence never loses its blocks to a less urgent one; and a sequence that does not fit
at admission, for want of blocks or of a slot (`max_num_seqs`), preempts running sequences of
less urgent classes until it does.

With prefix caching, a waiting sequence whose first block a running sequence is computing
right now waits (others may go ahead): a step later that block is cached and it shares the
prefix instead of computing it a second time.

How a victim gives up its KV (swap or recompute) is the scheduler's `PreemptionRule`, the same
under every policy, with swapped copies held in a bounded `SwapSpace` (`workers.scheduling.preemption`).
"""

from workers.scheduling.engine_config import SchedulerConfig
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.policies import PagedGreedyPolicy
from workers.scheduling.preemption import PreemptionRule, SwapSpace
from workers.scheduling.prefix_sharing import PrefixSharing
from workers.scheduling.scheduler_output import MispredictionEvent, ScheduledChunk, SchedulerOutput, SchedulerStats
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sequence import Sequence, SequenceStatus


class Scheduler:
    """Admission, reservation and preemption of one worker, as the policy decides.

    Args:
        config: step limits.
        allocator: the worker's block allocator.
        policy: decisions; on-demand paging (vLLM-style) when None.
        preemption: how victims give up their KV, whatever the policy; recompute only when None.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, policy: SchedulingPolicy | None = None,
                 preemption: PreemptionRule | None = None):
        self.config = config
        self.allocator = allocator
        self.policy = policy or PagedGreedyPolicy()
        self.policy.set_max_queue_wait(config.max_queue_wait_s)  # the bound its order may age by
        self.preemption = preemption or PreemptionRule(mode="recompute")
        self.swap_space = SwapSpace(self.preemption.swap_space_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.num_steps = 0
        self._now_s: float | None = None  # the clock of the step being scheduled
        self.prefixes = PrefixSharing(allocator)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; one that brings its KV (a moved request, `is_swapped`) holds that copy in swap space."""
        if seq.is_swapped:
            self.swap_space.hold(seq.seq_id, self.allocator.blocks_for(seq.num_computed_tokens))
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now_s: float | None = None) -> SchedulerOutput:
        """Pick the chunks of the next step, reserving the blocks they write. `now_s`, on the clock of the
        sequences' `arrival_s`, lets one that has waited `max_queue_wait_s` go first; None: no such bound."""
        self.num_steps += 1
        self._now_s = now_s
        self.policy.on_step(self.running)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.stats.num_preemptions
        # Most urgent class first (a victim is taken from the least urgent, so it is rarely scheduled
        # yet); within a class decodes first (one token each, in admission order), then prefill
        # chunks: a long prompt must not take the step's budget from decodes.
        for seq in sorted(self.running, key=lambda s: (s.priority, s.num_uncomputed_tokens > 1)):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            fits, freed_tokens = self._ensure_capacity(seq, out)
            budget += freed_tokens
            if not fits:
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens > 0:
                out.chunks.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
        if self.stats.num_preemptions == preemptions_before:
            # Admitting right after a preemption would hand the freed blocks
            # straight back and thrash.
            self._admit(out, budget, now_s)
        # The tables once every growth, preemption and admission of the step is done.
        out.chunks = [ScheduledChunk(c.seq, c.num_tokens, self.allocator.block_table(c.seq.seq_id))
                      for c in out.chunks]
        return out

    def commit(self, seq: Sequence) -> None:
        """After a step: blocks the sequence filled with computed KV become shareable (prefix caching)."""
        self.allocator.commit(seq.seq_id, seq.num_computed_tokens, seq.tokens_between)

    def trim(self, seq: Sequence) -> int:
        """After its bound dropped: a policy that holds its plan gives back the blocks beyond the new plan
        (keeping room for the token being sampled now); returns the blocks freed."""
        if not self.policy.holds_plan or not self.allocator.has(seq.seq_id):
            return 0
        return self.allocator.shrink(seq.seq_id, max(self.policy.reservation_tokens(seq), seq.num_tokens + 1))

    def recompute_instead(self, seq: Sequence, num_blocks: int) -> None:
        """The host copy of a sequence preempted by swapping (`num_blocks` blocks) could not be made: it computes
        its KV again."""
        if seq.is_swapped:
            seq.is_swapped = False
            self.swap_space.release(seq.seq_id)
            self.stats.num_swaps -= 1
            self.stats.num_swapped_blocks -= num_blocks
            self.stats.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks."""
        self.allocator.release(seq.seq_id)
        self.swap_space.release(seq.seq_id)
        self.prefixes.forget(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _admit(self, out: SchedulerOutput, budget: int, now_s: float | None) -> None:
        queue_position = {seq.seq_id: index for index, seq in enumerate(self.waiting)}  # arrival (preempted first)
        last_admitted: dict[int, int] = {}  # class -> queue position of its latest arrival admitted this step
        # sorted() is stable: the policy's order holds within each class, after those that waited or were passed
        # long enough.
        order = sorted(self.policy.admission_order(self.waiting), key=lambda s: (s.priority, *self._urgency(s, now_s)))
        in_progress = None  # prefixes.blocks_in_progress(), computed again after the running set changes
        refusals: list[tuple[object, int]] = []  # (policy's plan, blocks) refused beside the running ones or fewer
        asked_shorter_work = False  # the policy is asked once a step, for the first one that cannot start
        admitted: set[str] = set()  # this step's: never preempted for shorter work in the step that let them in
        for seq in order:
            if budget <= 0:
                break
            no_slot = len(self.running) >= self.config.max_num_seqs and not self._has_less_urgent(seq)
            if no_slot and asked_shorter_work:
                break  # no slot, and nobody running gives up theirs
            if in_progress is None:
                in_progress = self.prefixes.blocks_in_progress(self.running)
            if self.prefixes.waits_for_first_block(seq, in_progress):
                continue
            if no_slot:
                asked_shorter_work = True
                slot_victim = self._shorter_work_victim(seq, admitted)
                if slot_victim is None:
                    break
                budget += self._preempt_for(seq, slot_victim, out)
                in_progress, refusals = None, []
            blocks = self._try_allocate(seq, refusals)
            while blocks is None and self._less_urgent_would_make_room(seq):
                budget += self._preempt_less_urgent(seq, out)
                in_progress, refusals = None, []  # fewer running: earlier refusals prove nothing
                blocks = self._try_allocate(seq, refusals)
            if blocks is None and not asked_shorter_work:
                asked_shorter_work = True
                victim = self._shorter_work_victim(seq, admitted)
                if victim is not None:
                    budget += self._preempt_for(seq, victim, out)
                    in_progress, refusals = None, []
                    blocks = self._try_allocate(seq, refusals)
            if blocks is None:
                if self.policy.is_first_fit and self._urgency(seq, now_s)[0] == 3:
                    continue
                break  # FCFS, or waited or passed long enough: nobody overtakes it
            last_admitted[seq.priority] = max(last_admitted.get(seq.priority, -1), queue_position[seq.seq_id])
            if len(self.running) >= self.config.max_num_seqs:  # no slot left: a less urgent one gives up its own
                budget += self._preempt_less_urgent(seq, out)
                refusals = []
            in_progress = None
            admitted.add(seq.seq_id)
            self.waiting.remove(seq)
            if seq.admitted_s is None:
                seq.admitted_s = now_s
            seq.first_passed_step, seq.back_first = None, False
            self.prefixes.started(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_cached = self.allocator.num_cached_tokens(seq.seq_id)
            if seq.num_preemptions == 0 and not seq.is_swapped:
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
                self.stats.num_prompt_tokens_admitted += seq.num_prompt_tokens
                self.stats.num_prefix_hit_tokens += seq.num_cached_prompt_tokens
            if num_cached > seq.num_computed_tokens:  # its prefill starts after the cached prefix
                seq.num_computed_tokens = num_cached
            if seq.is_swapped:
                out.swap_in.append((seq, blocks[: self.allocator.blocks_for(seq.num_computed_tokens)]))
                self.swap_space.release(seq.seq_id)
                seq.is_swapped = False
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens > 0:
                out.chunks.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
        if self.policy.is_first_fit and last_admitted:
            self._mark_passed(queue_position, last_admitted)

    def _has_less_urgent(self, seq: Sequence) -> bool:
        return any(s.priority > seq.priority for s in self.running)

    def _mark_passed(self, queue_position: dict[str, int], last_admitted: dict[int, int]) -> None:
        """Waiting sequences that arrived before one of their class or a less urgent one admitted this step were
        passed (a more urgent one passing is priority, not starvation)."""
        for seq in self.waiting:
            position = queue_position.get(seq.seq_id)
            if seq.first_passed_step is not None or position is None:
                continue
            if any(position < last for priority, last in last_admitted.items() if priority >= seq.priority):
                seq.first_passed_step = self.num_steps

    def _urgency(self, seq: Sequence, now_s: float | None) -> tuple[int, float]:
        """Where `seq` goes within its class: (0, since) once it has waited `max_queue_wait_s` since it last joined the
        queue (oldest first), (1, 0) once passed for `max_overtaken_steps` steps, (2, 0) while it waits to come back
        after a preemption for KV (`preempted_first`), else (3, 0): the policy's order, the only place first fit
        passes one that does not fit."""
        since_s = seq.arrival_s if seq.queued_s is None else seq.queued_s
        if now_s is not None and now_s - since_s >= self.config.max_queue_wait_s:
            return 0, since_s
        if self._passed_enough(seq):
            return 1, 0.0
        return (2, 0.0) if seq.back_first else (3, 0.0)

    def _passed_enough(self, seq: Sequence) -> bool:
        """Later ones were admitted past waiting `seq` for `max_overtaken_steps` steps: it goes first, and
        nobody of its class or a less urgent one passes it again."""
        passed = seq.first_passed_step
        return passed is not None and self.num_steps - passed >= self.config.max_overtaken_steps

    def _ensure_capacity(self, seq: Sequence, out: SchedulerOutput) -> tuple[bool, int]:
        """Make room for all of `seq`'s known tokens, preempting as the policy says.

        Returns (False when `seq` itself was preempted, the step tokens victims already
        scheduled this step gave back).
        """
        if self.allocator.num_reserved_tokens(seq.seq_id) >= seq.num_tokens:
            return True, 0
        bound = self.policy.bound_after_overrun(seq)
        if bound is not None and bound != seq.predicted_output_tokens:
            self.stats.mispredictions.append(
                MispredictionEvent(seq.seq_id, seq.predicted_output_tokens, seq.num_output_tokens, self.num_steps)
            )
            seq.predicted_output_tokens = bound
        target_tokens = max(self.policy.growth_tokens(seq), seq.num_tokens)
        freed_tokens = 0
        while self.allocator.extend(seq.seq_id, target_tokens) is None:
            if self.allocator.extend(seq.seq_id, seq.num_tokens) is not None:
                return True, freed_tokens  # the full growth does not fit, but the next token does
            victim = self._choose_victim(seq, self.running)
            freed_tokens += self._unschedule(victim, out)
            self._preempt(victim, out, "kv")
            self.policy.on_preempted(victim, self.running)
            # Back first, where blocks are taken on demand (a policy holding whole plans, s3, lets its overrunner
            # wait for a larger plan than it gave up: none of the blocks it freed were enough for it).
            victim.back_first = self.config.preempted_first and not self.policy.holds_plan
            if victim is seq:
                return False, freed_tokens
        return True, freed_tokens

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> int:
        """Take `seq`'s chunk out of this step (it is about to be preempted); returns its tokens."""
        for chunk in out.chunks:
            if chunk.seq is seq:
                out.chunks.remove(chunk)
                return chunk.num_tokens
        return 0

    def _try_allocate(self, seq: Sequence, refusals: list[tuple[object, int]]) -> list[int] | None:
        """The blocks admitting `seq` takes now, if the policy admits it and they are free; else None. `refusals`:
        this step's, beside the running sequences or fewer (see `SchedulingPolicy.refused_too`); a new one joins."""
        hashes = self.prefixes.shareable_hashes(seq)
        # Policies plan per sequence; a block several running sequences hold (now, or once `seq` shares
        # it) is in several plans but in the pool once. An approximation: the credit is today's sharing,
        # applied to the whole horizon of the plan (s3_peak may admit a little early; overruns still
        # preempt). Cached blocks nobody holds are free blocks already and get no credit.
        num_blocks = self.allocator.num_blocks
        if hashes is not None:
            num_blocks += self.allocator.num_shared_holdings + self.allocator.cached_prefix_blocks(hashes,
                                                                                                  held_only=True)
        plan = self.policy.admission_plan(seq, self.config.max_num_batched_tokens)
        if plan is not None and any(blocks >= num_blocks and self.policy.refused_too(plan, refused)
                                    for refused, blocks in refusals):
            self.policy.on_refused(seq, self.running)
            return None
        if not self.policy.can_admit(seq, self.running, num_blocks, self.allocator.block_size,
                                     self.config.max_num_batched_tokens):
            self.policy.on_refused(seq, self.running)
            if plan is not None:
                refusals.append((plan, num_blocks))
            return None
        return self.allocator.allocate(seq.seq_id, self.policy.reservation_tokens(seq), hashes)

    def _choose_victim(self, seq: Sequence, pool: list[Sequence]) -> Sequence:
        """From the least urgent class in `pool`, whom the policy picks (the newest if it picks outside it)."""
        worst = max(s.priority for s in pool)
        candidates = [s for s in pool if s.priority == worst]
        victim = self.policy.choose_victim(seq, candidates)
        return victim if victim in candidates else candidates[-1]

    def _less_urgent_would_make_room(self, seq: Sequence) -> bool:
        """Preempting every running sequence less urgent than `seq` would let it in (blocks and policy alike).

        Conservative: only blocks no more urgent sequence also holds count as reclaimable, and
        the policy must admit `seq` beside the sequences that would stay.
        """
        less_urgent = [s for s in self.running if s.priority > seq.priority]
        return bool(less_urgent) and self._fits_without(seq, less_urgent)

    def _fits_without(self, seq: Sequence, leaving: list[Sequence]) -> bool:
        """Waiting `seq` would have its blocks and the policy's admission once running `leaving` gave up theirs."""
        leaving_ids = [s.seq_id for s in leaving]
        reclaimable = self.allocator.num_free_blocks + self.allocator.num_blocks_freed_by(leaving_ids)
        if self.allocator.blocks_for(self.policy.reservation_tokens(seq)) > reclaimable:
            return False
        staying = [s for s in self.running if s.seq_id not in leaving_ids]
        return self.policy.can_admit(seq, staying, self.allocator.num_blocks, self.allocator.block_size,
                                     self.config.max_num_batched_tokens)

    def _preempt_less_urgent(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt one running sequence less urgent than waiting `seq`; returns the step tokens it gave back."""
        victim = self._choose_victim(seq, [s for s in self.running if s.priority > seq.priority])
        freed = self._unschedule(victim, out)
        self._preempt(victim, out, "priority")
        return freed

    def _shorter_work_victim(self, seq: Sequence, admitted: set[str]) -> Sequence | None:
        """The running sequence (none more urgent than waiting `seq`, none `admitted` this step) the policy would
        preempt for `seq`'s shorter work, if `seq` then has a slot, its blocks and the policy's admission; else None.
        Only the least urgent class running is asked about: a class keeps its sequences while a less urgent one runs."""
        pool = [s for s in self.running if s.priority >= seq.priority and s.seq_id not in admitted]
        least_urgent = max((s.priority for s in pool), default=None)
        pool = [s for s in pool if s.priority == least_urgent]
        victim = self.policy.shorter_work_victim(seq, pool) if pool else None
        if victim is None or victim not in pool or not self._fits_without(seq, [victim]):
            return None
        return victim

    def _preempt_for(self, seq: Sequence, victim: Sequence, out: SchedulerOutput) -> int:
        """Preempt running `victim` for waiting `seq`'s shorter work; returns the step tokens it gave back."""
        freed = self._unschedule(victim, out)
        self._preempt(victim, out, "shorter_work")
        self.policy.on_preempted_for(victim, seq)
        return freed

    def _preempt(self, seq: Sequence, out: SchedulerOutput, cause: str) -> None:
        assert all(chunk.seq is not seq for chunk in out.chunks), f"{seq.seq_id} already runs this step"
        num_cached_blocks = self.allocator.blocks_for(seq.num_computed_tokens)
        swap = self.preemption.wants_swap(seq.num_computed_tokens)
        if swap and not self.swap_space.fits(num_cached_blocks):
            swap = False
            self.stats.num_swaps_over_budget += 1
        if swap:
            out.swap_out.append((seq, self.allocator.block_table(seq.seq_id)[:num_cached_blocks]))
            self.swap_space.hold(seq.seq_id, num_cached_blocks)
            seq.is_swapped = True
            self.stats.num_swaps += 1
            self.stats.num_swapped_blocks += num_cached_blocks
        else:
            self.stats.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
        self.allocator.release(seq.seq_id)
        self.prefixes.stopped(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.queued_s = self._now_s  # its wait for the starvation bound starts again (None: no clock)
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.stats.preemptions_by_cause[cause] += 1
        self.waiting.insert(0, seq)
