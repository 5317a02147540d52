"""Scheduling policies: how much KV to reserve, in which order to admit, whom to preempt.

Pure decisions over `Sequence` objects (no torch, no Ray, no Redis); the
`Scheduler` applies them to the block allocator. Same engine, same budget:

| policy         | reservation at admission      | when a sequence outruns it               |
|----------------|-------------------------------|------------------------------------------|
| max_reserve    | prompt + max_tokens           | never happens                            |
| paged_greedy   | the tokens known so far       | grow one block; if none, preempt newest  |
| s3             | prompt + predicted upper bound| grow to the next bound from free blocks, |
|                | (queue by size, first fit)    | else preempt it (swap or recompute) and  |
|                |                               | requeue it with the next bound           |
| oracle         | prompt + true output length   | never happens (benchmarks only)          |
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

    @abc.abstractmethod
    def reservation_tokens(self, seq: Sequence) -> int:
        """Tokens of KV to reserve when `seq` is admitted (at least its known tokens)."""

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        """Order in which waiting sequences are considered; arrival order by default."""
        return list(waiting)

    def growth_tokens(self, seq: Sequence) -> int:
        """Tokens to grow a reservation to when `seq` needs more than it holds."""
        return seq.num_tokens

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        """Whom to preempt when `seq` cannot grow; the newest running sequence by default."""
        return running[-1]

    def preemption_mode(self, seq: Sequence) -> PreemptionMode:
        return PreemptionMode.RECOMPUTE

    def on_overrun(self, seq: Sequence) -> None:
        """`seq` needs more than its reservation; policies that predict may update their bound."""

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        """Extra admission test beyond "the reservation's blocks are free"; none by default."""
        return True


class MaxReservePolicy(SchedulingPolicy):
    """Worst case: reserve prompt + max_tokens (FasterTransformer, ORCA-max)."""

    name = "max_reserve"

    def reservation_tokens(self, seq: Sequence) -> int:
        return max(seq.num_tokens, seq.max_total_tokens)


class PagedGreedyPolicy(SchedulingPolicy):
    """On-demand paging: blocks for what is known, grow as needed, preempt the newest (vLLM's default)."""

    name = "paged_greedy"

    def reservation_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens


class OraclePolicy(SchedulingPolicy):
    """Reserve prompt + the true output length (benchmarks force it, so it is known)."""

    name = "oracle"

    def reservation_tokens(self, seq: Sequence) -> int:
        true_tokens = seq.params.forced_output_tokens
        if true_tokens is None:
            raise ValueError(f"oracle policy needs forced_output_tokens on request {seq.seq_id!r}")
        return max(seq.num_tokens, seq.num_prompt_tokens + true_tokens)


def next_bound(current_bound: int, num_output_tokens: int, max_tokens: int, bucket_tokens: int) -> int:
    """The next larger output-length bound after an overrun: the next bucket edge, at least double, at most max_tokens."""
    next_edge = (num_output_tokens // bucket_tokens + 1) * bucket_tokens
    return min(max_tokens, max(next_edge, 2 * current_bound, num_output_tokens + 1))


class S3Policy(SchedulingPolicy):
    """Reserve prompt + predicted upper bound; pack largest first; on overrun grow or preempt and re-bound.

    Args:
        bucket_tokens: width of the predictor's length buckets (max_len / 10 in the paper);
            overruns move the bound to the next bucket edge at least.
        cost_model: picks swap or recompute for a preempted sequence.
    """

    name = "s3"
    is_first_fit = True

    def __init__(self, bucket_tokens: int = 102, cost_model: PreemptionCostModel | None = None) -> None:
        if bucket_tokens < 1:
            raise ValueError(f"bucket_tokens must be >= 1, got {bucket_tokens}")
        self.bucket_tokens = bucket_tokens
        self.cost_model = cost_model or PreemptionCostModel()

    def _bound(self, seq: Sequence) -> int:
        bound = seq.predicted_output_tokens
        return seq.params.max_tokens if bound is None else min(max(1, bound), seq.params.max_tokens)

    def reservation_tokens(self, seq: Sequence) -> int:
        return max(seq.num_tokens, seq.num_prompt_tokens + self._bound(seq))

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        # Decreasing predicted total size, arrival order among equals (sort is stable).
        return sorted(waiting, key=self.reservation_tokens, reverse=True)

    def on_overrun(self, seq: Sequence) -> None:
        if seq.num_output_tokens <= self._bound(seq):
            return  # still inside the bound; only the last block was missing
        seq.predicted_output_tokens = next_bound(
            self._bound(seq), seq.num_output_tokens, seq.params.max_tokens, self.bucket_tokens
        )

    def growth_tokens(self, seq: Sequence) -> int:
        return self.reservation_tokens(seq)

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        # The sequence that was mispredicted pays, not its neighbours.
        return seq

    def preemption_mode(self, seq: Sequence) -> PreemptionMode:
        return self.cost_model.cheaper_mode(seq.num_computed_tokens)

    def planned_output_tokens(self, seq: Sequence) -> int:
        """The bound to plan with: past the current bound, the next one (the overrun is coming)."""
        bound = self._bound(seq)
        if seq.num_output_tokens >= bound:
            return next_bound(bound, seq.num_output_tokens, seq.params.max_tokens, self.bucket_tokens)
        return bound


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
    token budget to itself); an overrun is handled as in s3.
    """

    name = "s3_peak"

    def reservation_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens

    def growth_tokens(self, seq: Sequence) -> int:
        return seq.num_tokens

    def _final_tokens(self, seq: Sequence) -> int:
        return max(seq.num_tokens, seq.num_prompt_tokens + self.planned_output_tokens(seq))

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        return sorted(waiting, key=self._final_tokens, reverse=True)

    def can_admit(
        self, seq: Sequence, running: list[Sequence], num_blocks: int, block_size: int, step_token_budget: int
    ) -> bool:
        # Per sequence: tokens held now, tokens at its last step, and steps of
        # prefill left before it starts growing (a chunked prompt takes several).
        plans = [
            (s.num_tokens, self._final_tokens(s), max(0, -(-s.num_uncomputed_tokens // step_token_budget) - 1))
            for s in [*running, seq]
        ]
        # Use only rises until someone leaves, so the peak falls on some sequence's last step.
        for horizon in sorted({delay + final - held for held, final, delay in plans}):
            in_use = sum(
                -(-min(held + max(0, horizon - delay), final) // block_size)
                for held, final, delay in plans
                if delay + final - held >= horizon
            )
            if in_use > num_blocks:
                return False
        return True


def make_policy(name: str, **kwargs) -> SchedulingPolicy:
    """Build a policy by name: max_reserve, paged_greedy, s3, s3_peak or oracle."""
    policies = {
        "max_reserve": MaxReservePolicy,
        "paged_greedy": PagedGreedyPolicy,
        "s3": S3Policy,
        "s3_peak": S3PeakPolicy,
        "oracle": OraclePolicy,
    }
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name](**kwargs)
