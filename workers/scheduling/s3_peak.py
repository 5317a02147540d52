"""s3_peak, the service's default policy: s3's plans held as a future peak of KV instead of whole reservations,
the queue ordered by predicted remaining work, preemption for much shorter work. Pure (no torch, Ray or Redis); the
registry is `workers.scheduling.policies`."""

import math

from workers.scheduling.engine_config import DEFAULT_MAX_QUEUE_WAIT_S
from workers.scheduling.kv_peak import Plan, holds_at_least, peak_fits
from workers.scheduling.length_distribution import LengthDistribution
from workers.scheduling.s3_policy import BUCKET_RANGE_TOKENS, DEFAULT_BUCKET_TOKENS, S3Policy
from workers.values.sequence import Sequence

ORDERS_BY_WORK = ("queue", "kv_scarce")  # S3PeakPolicy's order_by_work


class S3PeakPolicy(S3Policy):
    r"""Our extension of s3: plan the *future peak* of KV use instead of holding whole reservations.

    s3 holds prompt + bound blocks for a sequence's whole life although it
    fills them one token per step. Here blocks are taken on demand, as in
    paging, and a request is admitted only if, with every running sequence
    growing one token per step up to its predicted bound and then leaving,
    the KV in use never exceeds the budget at any future step:

        blocks
          ^         seq A ends
        B +-----------|----------------  budget
          |      ___/|      ___
          |  ___/    |  ___/   \___    total planned use (peak checked at
          | /        | /                 each running sequence's last step)
          +------------------------> steps

    With exact bounds it preempts only when prefill chunks shared by several
    prompts stretch a plan (each prompt is planned as if it had the step's
    token budget to itself); an overrun moves the bound to the next one, as in s3.

    It plans by the predictor's point estimate, not its upper bound
    (`prediction_from`): an underestimate costs a stretched plan, not a
    preemption, and the worker's length probe refines it as decoding goes on.

    Waiting requests are admitted shortest predicted remaining work first
    whenever a queue forms, whatever holds it back (the peak test, the slots
    of `max_num_seqs`, the step's token budget; with room for all, every one
    is admitted in the same step and the order only says whose prefill comes
    first). The order is aged: a request's key is its arrival plus
    `max_queue_wait_s` times its expected remaining work as a share of the
    length range, so it can be passed only by requests that arrived less than
    `max_queue_wait_s` after it, and once it has waited that long the
    scheduler puts it ahead of every newer one. "Remaining" is not the point
    minus what was decoded but the expected remaining output of the request's
    length distribution given that it is still going
    (`workers.scheduling.length_distribution`: a log-normal around its point,
    cut at max_tokens), so a sequence that outran its prediction, likely one
    that loops to the limit, stops looking nearly done. (Until 2026-11 the
    queue went shortest first only while KV was scarce, `order_by_work`
    "kv_scarce": a queue held back by slots or the token budget went first
    come first served, and the first token of a short answer waited behind
    every long one.)

    When a sequence cannot grow, the running one expected to hold its blocks
    longest is preempted, so those about to finish and free theirs keep going;
    and, as TRAIL limits preemption as a request grows, a sequence that has
    decoded at least `protect_fraction` of its expected length is preempted
    only when every candidate has. When a waiting request cannot start (no
    free slot, or the peak test refuses it) and its expected remaining work is
    at most 1 / `shorter_work_ratio` of a running sequence's, that running
    one (the longest expected, never one protected so, nor one preempted
    before) is preempted for it (`shorter_work_victim`), at most one every
    `shorter_work_gap_steps` steps: the victim swaps out (where victims can
    only be recomputed, `overcommit_options` turns this off, as the stretch
    below) and waits again under `order_key`, which keeps its arrival: one
    that arrived long ago comes back soon.

    The future peak needs every running sequence's progress, which only the
    worker sees, so the controller charges a request only its prompt
    (`admits_at_worker`) and this test decides when it runs. Charged its whole
    plan, the controller sent each worker no more than the plans' sum fits,
    and the peak test never had a say: in a simulated LLaMA-30B cluster on
    A100s, where KV is scarce, s3_peak then ran at 0.86x paged_greedy's
    tokens/s, and at 1.09x once the worker decided.

    The plans are estimates, and the peak they add up to is rarely reached:
    even with every plan exact (the oracle's lengths), holding the peak within
    the pool left KV emptier than paging keeps it (0.65 used against 0.79 on
    the CPU natural bench) and ran at 0.88x and 0.98x its tokens/s in two runs,
    while requests waited seconds for their first token (paging: 0.3 s). So the
    budget the peak test checks stretches as congestion control would: by
    `overcommit_step` of the pool after each step in which the test refused a
    request while something ran and nothing was preempted, up to
    `max_overcommit`, and it halves after each step that preempted for want of
    blocks. It keeps its value while the worker idles: it measures how far the
    plans overstate the peak, not how busy the worker is. Requests then wait
    no longer than preemptions say they must, and the plans still decide who
    goes first and who is preempted. The stretch bets that a preemption costs
    less than blocks left idle; where victims can only be recomputed
    (`preemption_mode` recompute, as vLLM V1 and OpenVINO preempt) each one
    redoes its whole prefix, and the bet loses: on 100 P8 requests at 0.05 GiB
    (bench peers' second hundred; 2026-11-28) 77 preemptions and 5,669 tokens
    recomputed at 0.01 against 9 and 960 without the stretch, which ran 1.19x
    the tokens/s, so `overcommit_options` turns it off there.

    The aging bound is the scheduler's `max_queue_wait_s` (`set_max_queue_wait`; 30 s until a scheduler hands
    over its own).

    Args:
        length_range_tokens: the output lengths the order's aging spans (`length_range_tokens(max_model_len)`).
        order_by_work: "queue" (shortest remaining work first whenever a queue forms) or "kv_scarce" (only
            within `pressure_window_steps` steps of a refusal or a preemption for want of blocks; first come first
            served otherwise), kept to measure the one against the other.
        pressure_window_steps: steps after the peak test last refused a request
            (or a sequence was preempted) during which KV counts as scarce.
        overcommit_step: share of the pool the checked budget grows by per refusing
            step without a preemption (0: the peak always within the pool).
        max_overcommit: the most the checked budget exceeds the pool by, as a share of it.
        length_sigma: spread of each request's log output length around its point estimate (the
            distribution that ranks remaining work).
        protect_fraction: share of its expected length a sequence must have decoded to be preempted last
            (1 or more: never protected), and never for shorter work.
        shorter_work_ratio: how many times a waiting request's expected remaining work a running one's must be
            for the running one to be preempted for it (0: never preempt for shorter work).
        shorter_work_gap_steps: the fewest steps between two preemptions for shorter work.
    """

    name = "s3_peak"
    holds_plan = False
    admits_at_worker = True

    def __init__(self, bucket_tokens: int = DEFAULT_BUCKET_TOKENS, length_range_tokens: int = BUCKET_RANGE_TOKENS,
                 order_by_work: str = "queue", pressure_window_steps: int = 64, overcommit_step: float = 0.01,
                 max_overcommit: float = 1.0, length_sigma: float = 1.0, protect_fraction: float = 0.5,
                 shorter_work_ratio: float = 4.0, shorter_work_gap_steps: int = 16) -> None:
        super().__init__(bucket_tokens)
        if protect_fraction <= 0:
            raise ValueError(f"protect_fraction must be > 0, got {protect_fraction}")
        self.lengths = LengthDistribution(default_sigma=length_sigma)
        self.protect_fraction = protect_fraction
        if length_range_tokens < 1 or pressure_window_steps < 1:
            raise ValueError(f"need length_range_tokens >= 1 and pressure_window_steps >= 1, got "
                             f"{length_range_tokens} and {pressure_window_steps}")
        if order_by_work not in ORDERS_BY_WORK:
            raise ValueError(f"order_by_work must be one of {', '.join(ORDERS_BY_WORK)}, got {order_by_work!r}")
        if overcommit_step < 0 or max_overcommit < 0:
            raise ValueError(f"need overcommit_step >= 0 and max_overcommit >= 0, got {overcommit_step} and "
                             f"{max_overcommit}")
        if shorter_work_ratio < 0 or shorter_work_gap_steps < 1:
            raise ValueError(f"need shorter_work_ratio >= 0 and shorter_work_gap_steps >= 1, got "
                             f"{shorter_work_ratio} and {shorter_work_gap_steps}")
        self.max_queue_wait_s = DEFAULT_MAX_QUEUE_WAIT_S
        self.length_range_tokens = length_range_tokens
        self.order_by_work = order_by_work
        self.pressure_window_steps = pressure_window_steps
        self.overcommit_step = overcommit_step
        self.max_overcommit = max_overcommit
        self.shorter_work_ratio = shorter_work_ratio
        self.shorter_work_gap_steps = shorter_work_gap_steps
        # Admission state of one worker's scheduler (what it learns from refusals and preemptions); the planning
        # rule above it reads none of it.
        self._steps_since_refusal = pressure_window_steps
        self._refused = False
        self._preempted = False
        self._steps_since_shorter_work = shorter_work_gap_steps
        self.overcommit = 0.0  # the checked budget is the pool x (1 + this)

    @property
    def kv_scarce(self) -> bool:
        """The peak test refused a request, or a sequence was preempted, in one of the last
        `pressure_window_steps` steps; never with nothing running (every block is free then)."""
        return self._steps_since_refusal < self.pressure_window_steps

    def on_step(self, running: list[Sequence]) -> None:
        self._steps_since_shorter_work += 1
        if self._preempted:
            self.overcommit /= 2
        elif running and self._refused:
            self.overcommit = min(self.max_overcommit, self.overcommit + self.overcommit_step)
        if not running:
            self._steps_since_refusal = self.pressure_window_steps
        else:
            self._steps_since_refusal = 0 if self._refused else self._steps_since_refusal + 1
        self._refused = self._preempted = False

    def on_preempted(self, victim: Sequence, running: list[Sequence]) -> None:
        self._refused = True  # a sequence could not grow: as scarce as a refusal
        self._preempted = True

    def remaining_tokens(self, seq: Sequence) -> float:
        """Output tokens `seq` is expected to generate still, given that it is still going (its length distribution
        around its point, refined by the worker's probe where one runs); max_tokens - decoded without a prediction."""
        return self.lengths.remaining_of(seq.length_center_tokens, seq.num_output_tokens, seq.params.max_tokens,
                                         seq.is_looping)

    def is_protected(self, seq: Sequence) -> bool:
        """It has decoded `protect_fraction` of its expected length: preempted only if every candidate is."""
        decoded = seq.num_output_tokens
        return decoded > 0 and decoded >= self.protect_fraction * (decoded + self.remaining_tokens(seq))

    def set_max_queue_wait(self, max_queue_wait_s: float) -> None:
        if not 0 <= max_queue_wait_s < math.inf:
            raise ValueError(f"max_queue_wait_s must be finite and >= 0, got {max_queue_wait_s}")
        self.max_queue_wait_s = max_queue_wait_s

    def order_key(self, seq: Sequence) -> float:
        """Its place in the admission order (smallest first): arrival plus `max_queue_wait_s` times its expected
        remaining work as a share of the length range (all of it from `length_range_tokens` on), so a newer
        request goes first only when it is predicted shorter by more than their arrival gap is worth."""
        share = min(1.0, self.remaining_tokens(seq) / self.length_range_tokens)
        return seq.arrival_s + self.max_queue_wait_s * share

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        if self.order_by_work == "kv_scarce" and not self.kv_scarce:
            return list(waiting)
        return sorted(waiting, key=self.order_key)

    def shorter_work_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        # The longest expected of those that may go (not protected, never preempted before), if it is expected to
        # run `shorter_work_ratio` times longer than `seq`; at most one every `shorter_work_gap_steps` steps.
        if self.shorter_work_ratio <= 0 or self._steps_since_shorter_work < self.shorter_work_gap_steps:
            return None
        candidates = [s for s in running if s.num_preemptions == 0 and not self.is_protected(s)]
        if not candidates:
            return None
        victim = max(candidates, key=lambda s: (self.remaining_tokens(s), -s.num_computed_tokens))
        if self.remaining_tokens(victim) < self.shorter_work_ratio * max(1.0, self.remaining_tokens(seq)):
            return None
        return victim

    def on_preempted_for(self, victim: Sequence, seq: Sequence) -> None:
        self._steps_since_shorter_work = 0
        self._refused = False  # the refusal that asked for it was resolved: no stretch, no scarcity from it

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        # Unprotected first (TRAIL); then the one expected to hold its blocks longest, among those preempted least
        # often (so the same long request is not pushed out again each time it comes back); then the one with least
        # KV to redo or copy.
        return max(running, key=lambda s: (not self.is_protected(s), -s.num_preemptions, self.remaining_tokens(s),
                                           -s.num_computed_tokens))

    def growth_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        plans = [self.admission_plan(s, step_token_budget) for s in [*running, seq]]
        return peak_fits(plans, block_size, int(num_blocks * (1 + self.overcommit)))

    def admission_plan(self, seq: Sequence, step_token_budget: int) -> Plan:
        """Tokens held now, tokens at its last step, and steps of prefill left before it starts growing (a chunked
        prompt takes several)."""
        return (seq.num_tokens, self.planned_tokens_of(seq),
                max(0, -(-seq.num_uncomputed_tokens // step_token_budget) - 1))

    def refused_too(self, plan: Plan, refused_plan: Plan) -> bool:
        return holds_at_least(plan, refused_plan)

    def on_refused(self, seq: Sequence, running: list[Sequence]) -> None:
        self._refused = True

