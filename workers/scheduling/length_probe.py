"""The worker's own length predictor: it reads a sequence's hidden state where the engine samples.

The router's text predictor gives the first bound (placement needs one before any
forward). Inside the worker the model has already read the prompt: the final-norm
hidden state of the row a step samples from (the lm_head's input, free since the
forward computes it anyway) says more about how the answer will go. A `LengthProbe`
maps those rows to an estimate of the tokens still to come (a point and an upper
bound), at the prefill's sample and again every `interval_tokens` decoded tokens; the
engine writes `num_output_tokens + remaining` as the sequence's
`predicted_output_tokens`, which the length-aware policies plan by. Which of the two:
a policy that holds its plan (s3 reserves it whole) takes the upper bound, since an
overrun there costs a preemption; a policy that takes blocks on demand and only admits
by the plan (s3_peak) takes the point, refined as decoding goes on, since an overrun
there only stretches a plan (`remaining_for`).

Pure decisions (no torch import): the engine passes the rows, an implementation brings
its own model. The service's is the predictor's hidden-state probe
(`predictor_service.hidden_probe`), which imports nothing of the workers: the cluster
wraps it in this interface and hands the worker a loader (`cluster.control.worker_probe`).
"""

import abc
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProbeQuery:
    """One sequence at a step where the probe reads it.

    Attributes:
        seq_id: the request.
        num_prompt_tokens: prompt length in tokens.
        num_output_tokens: tokens decoded before the one being sampled (0: the prompt's prefill just ended).
        max_tokens: the request's generation limit.
    """

    seq_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int

    @property
    def max_remaining_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens


@dataclass(frozen=True, slots=True)
class RemainingEstimate:
    """Tokens still to generate, the one being sampled included: a point estimate and an upper bound."""

    point_tokens: int
    upper_tokens: int


def remaining_for(estimate: RemainingEstimate | None, holds_plan: bool) -> int | None:
    """The estimate a policy plans by: the upper bound if it reserves its plan, else the point."""
    if estimate is None:
        return None
    return estimate.upper_tokens if holds_plan else estimate.point_tokens


class LengthProbe(abc.ABC):
    """Bounds the remaining output of sequences from their hidden states.

    Attributes:
        interval_tokens: read a sequence when its decoded count is a multiple of this (0 included). Each probe sets
            its own: a trained one the interval it was trained at (`predictor_service.probe_files.ProbeConfig`).
        refines_bounds: False for probes that only watch (feature recording): the engine runs them under every
            policy, not only under those that plan by a refinable prediction.
        reads_forced: also read sequences whose length a benchmark forces (`forced_output_tokens`). Off by
            default: a forced length is usually not the model's own, so its states say nothing about it; a bench
            whose forced lengths are the model's own greedy ones (`bench peers --workload natural`) turns it on.
    """

    interval_tokens: int
    refines_bounds: bool = True
    reads_forced: bool = False

    def is_due(self, num_output_tokens: int) -> bool:
        """Whether a sequence that has decoded `num_output_tokens` is read at this step."""
        return num_output_tokens % self.interval_tokens == 0

    @abc.abstractmethod
    def estimate_remaining(self, hidden, queries: list[ProbeQuery]) -> list[RemainingEstimate | None]:
        """hidden: [len(queries), hidden_size] float32 tensor, row i for queries[i].

        Returns per query the tokens still to generate (each in [1, max_remaining_tokens]),
        or None to keep the current bound.
        """


def refined_bound(query: ProbeQuery, remaining_tokens: int | None, current: int | None) -> int | None:
    """The sequence's new `predicted_output_tokens` from a probe's answer (clamped into what can still happen)."""
    if remaining_tokens is None:
        return current
    remaining = min(max(1, int(remaining_tokens)), query.max_remaining_tokens)
    return query.num_output_tokens + remaining
