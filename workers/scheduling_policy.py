"""The scheduling policy's interface: the decisions a worker's scheduler asks for, and how to preempt.

`SchedulingPolicy` is what every policy in `workers.policies` implements; `PreemptionCostModel`
estimates whether swapping a preempted sequence's KV to host memory or recomputing it is cheaper
(the scheduler's `workers.preemption.PreemptionRule` applies it to every policy alike). Pure
decisions: no torch, no Ray, no Redis.
"""

import abc
import enum
from dataclasses import dataclass

from workers.sequence import Sequence


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # drop the KV; prefill prompt + outputs again later
    SWAP = "swap"  # copy the KV to host memory; copy it back on re-admission


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    """Chooses swap or recompute by estimated seconds.

    Attributes:
        prefill_s_per_token: time to recompute one token's KV.
        swap_bytes_per_s: device<->host copy bandwidth.
        kv_bytes_per_token: KV bytes of one token across all layers.
        swap_overhead_s: fixed cost of one copy, so very short sequences recompute.
    """

    prefill_s_per_token: float = 1e-3
    swap_bytes_per_s: float = 5e9
    kv_bytes_per_token: int = 46_080
    swap_overhead_s: float = 1e-3

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def swap_s(self, num_tokens: int) -> float:
        # out now, back in later, each copy with a fixed launch/bookkeeping cost
        return 2 * (self.swap_overhead_s + num_tokens * self.kv_bytes_per_token / self.swap_bytes_per_s)

    def cheaper_mode(self, num_tokens: int) -> PreemptionMode:
        if self.swap_s(num_tokens) < self.recompute_s(num_tokens):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


class SchedulingPolicy(abc.ABC):
    """Decisions the scheduler asks for; implementations hold no per-sequence state."""

    name: str = "abstract"
    #: Keep scanning the waiting queue past a request that does not fit.
    is_first_fit: bool = False
    #: The allocator reserves the whole plan at admission; False: blocks on demand, the plan only decides admission.
    holds_plan: bool = True
    #: Usable by the service; False for benchmark instruments (they need the true output length).
    is_serving: bool = True
    #: Plans by `predicted_output_tokens` as a prediction the worker may refine (a length probe's answers go there).
    reads_prediction: bool = False
    #: The worker's admission test needs what the controller cannot see (every running sequence's progress), so
    #: the controller charges a request only what it holds on admission and leaves the rest to that test.
    admits_at_worker: bool = False

    def prediction_from(self, point_tokens: int, upper_tokens: int) -> int:
        """Which of a predictor's two answers this policy plans by: the upper bound when it reserves its plan
        whole (an overrun there costs a preemption), the point when it takes blocks on demand and only admits
        by the plan (an overrun there stretches the plan; `length_probe.remaining_for` chooses the same way)."""
        return upper_tokens if self.holds_plan else point_tokens

    @abc.abstractmethod
    def planned_output_tokens(self, num_output_tokens: int, max_tokens: int, predicted_output_tokens: int | None,
                              forced_output_tokens: int | None = None) -> int:
        """Output tokens the plan covers (the part of `planned_tokens` that differs between policies)."""

    def planned_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                       predicted_output_tokens: int | None, forced_output_tokens: int | None = None) -> int:
        """KV tokens a request is planned to hold at its peak: the one rule router, controller and worker share.

        Raises ValueError for values no request can have (the message shows them).
        """
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"num_prompt_tokens and max_tokens must be >= 1, got {num_prompt_tokens} and {max_tokens}")
        if not 0 <= num_output_tokens < max_tokens:
            raise ValueError(f"num_output_tokens must be in [0, max_tokens={max_tokens}) for a request that still "
                             f"generates, got {num_output_tokens}")
        planned = self.planned_output_tokens(num_output_tokens, max_tokens, predicted_output_tokens,
                                             forced_output_tokens)
        return num_prompt_tokens + max(num_output_tokens, planned)

    def placement_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                         predicted_output_tokens: int | None, forced_output_tokens: int | None = None) -> int:
        """KV tokens the controller's ledger charges a worker for a request: its plan (`planned_tokens`), or,
        for a policy whose worker admits by its own test (`admits_at_worker`), the tokens it holds on admission.

        Raises ValueError as `planned_tokens` does.
        """
        planned = self.planned_tokens(num_prompt_tokens, num_output_tokens, max_tokens, predicted_output_tokens,
                                      forced_output_tokens)
        return num_prompt_tokens + num_output_tokens if self.admits_at_worker else planned

    def planned_tokens_of(self, seq: Sequence) -> int:
        """`planned_tokens` of a live sequence (it may have reached max_tokens: then what it holds)."""
        if seq.num_output_tokens >= seq.params.max_tokens:
            return seq.num_tokens
        return self.planned_tokens(seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens,
                                   seq.predicted_output_tokens, seq.params.forced_output_tokens)

    def reservation_tokens(self, seq: Sequence) -> int:
        """Tokens of KV to reserve when `seq` is admitted: its plan, or (on demand) what it holds."""
        if self.holds_plan:
            return max(seq.num_tokens, self.planned_tokens_of(seq))
        return seq.num_tokens

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        """Order in which waiting sequences are considered; arrival order by default."""
        return list(waiting)

    def growth_tokens(self, seq: Sequence) -> int:
        """Tokens to grow a reservation to when `seq` needs more than it holds."""
        return seq.num_tokens

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        """Whom to preempt when `seq` cannot grow; the newest running sequence by default."""
        return running[-1]

    def on_overrun(self, seq: Sequence) -> None:
        """`seq` needs more than its reservation; policies that predict may update their bound."""

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        """Extra admission test beyond "the reservation's blocks are free"; none by default. The scheduler may
        also ask it of a subset of `running` (would preempting the less urgent make room?), and only after
        the real test or the allocation failed; a policy may keep scheduler-level state from its answers."""
        return True

    def on_step(self, running: list[Sequence]) -> None:
        """A step begins with these sequences running; policies that learn from steps update here."""

    def on_preempted(self, victim: Sequence, running: list[Sequence]) -> None:
        """`victim` lost its blocks because a running sequence could not grow (not to make room for a more
        urgent class); `running` are the sequences that kept theirs."""
