"""The S3 paper's policy: reserve prompt + predicted upper bound, pack largest first, and on an overrun grow the
reservation or preempt the sequence and plan it by the next bucket edge. Pure (no torch, Ray or Redis); the registry
is `workers.scheduling.policies`."""

from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sequence import Sequence


#: Output lengths the s3 family's 10 buckets (and the length predictor's histogram) span at most: the paper's
#: 10 buckets over a 2048-token context. A model's own, longer context (SmolLM2's 8,192, Gemma 3's 32,768, the
#: service's default max_model_len) would make each bucket wider than most answers are long; a longer answer
#: falls in the last bucket and outruns its bound as any other does.
BUCKET_RANGE_TOKENS = 2048
DEFAULT_BUCKET_TOKENS = 102  # the paper's max_len / 10 at 1,024 tokens (make_policy widens it with max_model_len)


def next_bound(current_bound: int, num_output_tokens: int, max_tokens: int, bucket_tokens: int) -> int:
    """The next larger output-length bound after an overrun: the next bucket edge, at least double, at most max_tokens."""
    next_edge = (num_output_tokens // bucket_tokens + 1) * bucket_tokens
    return min(max_tokens, max(next_edge, 2 * current_bound, num_output_tokens + 1))


class S3Policy(SchedulingPolicy):
    """Reserve prompt + predicted upper bound; pack largest first; on overrun grow or preempt and re-bound.

    Args:
        bucket_tokens: width of the predictor's length buckets (max_len / 10 in the paper);
            overruns move the bound to the next bucket edge at least.
    """

    name = "s3"
    reads_prediction = True
    is_first_fit = True

    def __init__(self, bucket_tokens: int = DEFAULT_BUCKET_TOKENS) -> None:
        if bucket_tokens < 1:
            raise ValueError(f"bucket_tokens must be >= 1, got {bucket_tokens}")
        self.bucket_tokens = bucket_tokens

    def _bound(self, seq: Sequence) -> int:
        return self._clamped(seq.predicted_output_tokens, seq.params.max_tokens)

    @staticmethod
    def _clamped(bound: int | None, max_tokens: int) -> int:
        return max_tokens if bound is None else min(max(1, bound), max_tokens)

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced_output_tokens=None):
        """The predicted bound; past it, the next one (the overrun is coming)."""
        bound = self._clamped(predicted_output_tokens, max_tokens)
        if num_output_tokens >= bound:
            return next_bound(bound, num_output_tokens, max_tokens, self.bucket_tokens)
        return bound

    def admission_order(self, waiting: list[Sequence]) -> list[Sequence]:
        # Decreasing planned total size, arrival order among equals (sort is stable).
        return sorted(waiting, key=self.planned_tokens_of, reverse=True)

    def bound_after_overrun(self, seq: Sequence) -> int | None:
        if seq.num_output_tokens <= self._bound(seq):
            return None  # still inside the bound; only the last block was missing
        return next_bound(self._bound(seq), seq.num_output_tokens, seq.params.max_tokens, self.bucket_tokens)

    def growth_tokens(self, seq: Sequence) -> int:
        return self.reservation_tokens(seq)

    def choose_victim(self, seq: Sequence, running: list[Sequence]) -> Sequence:
        # The sequence that was mispredicted pays, not its neighbours.
        return seq

