"""The worker's own length predictor: it reads a sequence's hidden state where the engine samples.

The router's text predictor gives the first bound (placement needs one before any
forward). Inside the worker the model has already read the prompt: the final-norm
hidden state of the row a step samples from (the lm_head's input, free since the
forward computes it anyway) says more about how the answer will go. A `LengthProbe`
maps those rows to a bound on the tokens still to come, at the prefill's sample and
again every `interval_tokens` decoded tokens; the engine writes
`num_output_tokens + bound` as the sequence's `predicted_output_tokens`, which the
length-aware policies plan by.

Pure decisions (no torch import): the engine passes the rows, implementations
(`predictor_service.hidden_probe`) bring their own model.
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


class LengthProbe(abc.ABC):
    """Bounds the remaining output of sequences from their hidden states.

    Attributes:
        interval_tokens: read a sequence when its decoded count is a multiple of this (0 included).
    """

    interval_tokens: int = 64

    def is_due(self, num_output_tokens: int) -> bool:
        """Whether a sequence that has decoded `num_output_tokens` is read at this step."""
        return num_output_tokens % self.interval_tokens == 0

    @abc.abstractmethod
    def bound_remaining(self, hidden, queries: list[ProbeQuery]) -> list[int | None]:
        """hidden: [len(queries), hidden_size] float32 tensor, row i for queries[i].

        Returns per query an upper bound on the tokens still to generate, the one being
        sampled included (in [1, max_remaining_tokens]), or None to keep the current bound.
        """


def refined_bound(query: ProbeQuery, remaining_tokens: int | None, current: int | None) -> int | None:
    """The sequence's new `predicted_output_tokens` from a probe's answer (clamped into what can still happen)."""
    if remaining_tokens is None:
        return current
    remaining = min(max(1, int(remaining_tokens)), query.max_remaining_tokens)
    return query.num_output_tokens + remaining
