"""Scheduling policies: how much KV to plan for, in which order to admit, whom to preempt.

Pure decisions (no torch, no Ray, no Redis). Each policy has ONE planning rule, stateless
(`workers.scheduling.planning_rule.PlanningRule`), `planned_tokens(num_prompt, num_output, max_tokens,
predicted, forced)`: the KV tokens a request is planned to hold at its peak. The worker's
scheduler reserves by it (or, for on-demand policies, admits by it), the controller's ledger
places by it (`placement_tokens`: except for s3_peak and sglang_ratio, whose worker-side tests
need progress only the worker sees), and a moved request carries the bound it works from. What
one worker learns (s3_peak's stretch of its budget, sglang_ratio's ratio) is admission state
(`workers.scheduling.scheduling_policy.SchedulingPolicy`), never read by the rule. The registry below is the
only list of names; docs/policies.md is the contract. Same engine, same budget:

| policy         | reservation at admission      | when a sequence outruns it               |
|----------------|-------------------------------|------------------------------------------|
| max_reserve    | prompt + max_tokens           | never happens                            |
| paged_greedy   | the tokens known so far       | grow one block; if none, preempt newest  |
| s3             | prompt + predicted upper bound| grow to the next bound from free blocks, |
|                | (queue by size, first fit)    | else preempt it and requeue it with the  |
|                |                               | next bound                               |
| oracle         | prompt + true output length   | never happens (benchmarks only)          |
| sglang_ratio   | the tokens known so far; admit| retract the fewest-decoded sequence;     |
|                | if prompt + max_tokens of the | reset the ratio from what the running    |
|                | new one + remaining x ratio of| ones decoded                             |
|                | the running ones fit          |                                          |

A policy chooses whom to preempt, never how: every victim gives up its KV by the scheduler's
`workers.scheduling.preemption.PreemptionRule` (swap within a host budget, or recompute), the same for all.
"""

from workers.scheduling.planning_rule import PlanningRule
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.s3_policy import BUCKET_RANGE_TOKENS, S3Policy
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.scheduling.sglang_ratio import SGLangRatioPolicy
from workers.values.sequence import Sequence

class MaxReservePolicy(SchedulingPolicy):
    """Worst case: reserve prompt + max_tokens (FasterTransformer, ORCA-max)."""

    name = "max_reserve"

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced_output_tokens=None):
        return max_tokens


class PagedGreedyPolicy(SchedulingPolicy):
    """On-demand paging: blocks for what is known, grow as needed, preempt the newest (vLLM's default)."""

    name = "paged_greedy"
    holds_plan = False

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced_output_tokens=None):
        return num_output_tokens  # plans nothing ahead: what it holds now


class OraclePolicy(SchedulingPolicy):
    """Reserve prompt + the true output length (benchmarks force it, so it is known).

    Args:
        from_prediction: the true length arrives as the prediction instead (a benchmark that lets
            answers end naturally gives the labelled length there); it is then not forced.
    """

    name = "oracle"
    is_serving = False

    def __init__(self, from_prediction: bool = False) -> None:
        self.from_prediction = from_prediction

    def _true_length(self, predicted: int | None, forced: int | None, where: str) -> int:
        true = predicted if self.from_prediction else forced
        if true is None:
            field_name = "predicted_output_tokens" if self.from_prediction else "forced_output_tokens"
            raise ValueError(f"the oracle policy needs {field_name} (the true length), a benchmark setting{where}")
        return true

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced_output_tokens=None):
        return self._true_length(predicted_output_tokens, forced_output_tokens, "")

    def reservation_tokens(self, seq: Sequence) -> int:
        self._true_length(seq.predicted_output_tokens, seq.params.forced_output_tokens, f", on request {seq.seq_id!r}")
        return super().reservation_tokens(seq)



POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls
    for cls in (MaxReservePolicy, PagedGreedyPolicy, S3Policy, S3PeakPolicy, SGLangRatioPolicy, OraclePolicy)
}
POLICY_NAMES = tuple(POLICIES)
SERVING_POLICY_NAMES = tuple(name for name, cls in POLICIES.items() if cls.is_serving)
#: What the service runs unless told otherwise: the policy that measured best with the shipped predictor on
#: throughput and latency together (docs/features.md, "The defaults, and the measurements behind them"); s3
#: stays for reproducing the paper.
DEFAULT_POLICY = "s3_peak"


def overcommit_options(name: str, overcommit_step: float | None, can_swap: bool = True) -> dict:
    """make_policy's keywords for s3_peak's bets on cheap preemption: `overcommit_step` the one set, else the
    policy's default where preempted sequences may be swapped and 0 where they are only recomputed (`can_swap`
    False, see S3PeakPolicy); there `shorter_work_ratio` 0 too (no preemption for shorter work)."""
    if name != "s3_peak":
        return {}
    options = {} if can_swap else {"overcommit_step": 0.0, "shorter_work_ratio": 0.0}
    if overcommit_step is not None:
        options["overcommit_step"] = overcommit_step
    return options


def length_range_tokens(max_model_len: int | None) -> int:
    """The output lengths the buckets span for this context: max_model_len, at most BUCKET_RANGE_TOKENS (that
    with none given)."""
    return BUCKET_RANGE_TOKENS if max_model_len is None else min(max_model_len, BUCKET_RANGE_TOKENS)


def make_rule(name: str, max_model_len: int | None = None, **kwargs) -> PlanningRule:
    """The planning rule of policy `name`, for the router and the controller: they ask only what every worker
    shares (which estimate, what to charge, what a moved request plans by), never a worker's admission state."""
    return make_policy(name, max_model_len, **kwargs)


def make_policy(name: str, max_model_len: int | None = None, **kwargs) -> SchedulingPolicy:
    """Build a policy by registry name. With `max_model_len`, the s3 family's length buckets are a tenth of
    `length_range_tokens(max_model_len)` wide (the paper's max_len / 10), unless `bucket_tokens` is given, and
    s3_peak's order ages over that range (by the bound its scheduler hands it)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    cls = POLICIES[name]
    if issubclass(cls, S3Policy) and max_model_len is not None:
        kwargs.setdefault("bucket_tokens", max(1, length_range_tokens(max_model_len) // 10))
    if issubclass(cls, S3PeakPolicy):
        kwargs.setdefault("length_range_tokens", length_range_tokens(max_model_len))
    return cls(**kwargs)
