"""A request's tokens and progress inside one worker's engine."""

import enum
from dataclasses import dataclass, field

from workers.values.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; no KV in the cache
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Tokens of one request and how many of them have KV in the cache.

    A sequence always computes `all_token_ids[num_computed_tokens:]` next: the
    rest of its prompt while prefilling, the last sampled token while decoding,
    and everything again after it was preempted and its blocks dropped.
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_text: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    predicted_output_tokens: int | None = None  # the length predictor's upper bound, if any
    # The latest *prediction* of its length (the router's, then the probe's), which the bound raised after an
    # overrun does not change: the centre of its length distribution (`workers.scheduling.length_distribution`).
    predicted_center_tokens: int | None = None
    num_probe_reads: int = 0  # times the worker's length probe re-bounded it from its hidden state
    is_swapped: bool = False  # its computed KV waits in host memory
    is_looping: bool = False  # its answer repeats itself (`workers.scheduling.repetition`): likely to run to max_tokens
    priority: int = 0  # class: lower is more urgent; admitted first, preempted last
    first_passed_step: int | None = None  # scheduler step a later one was first admitted past it, waiting
    back_first: bool = False  # preempted for KV: back before the policy's order (the scheduler's preempted_first)
    admitted_s: float | None = None  # when the scheduler first admitted it, on the clock of `arrival_s`
    queued_s: float | None = None  # when it last went back to the queue (preempted); None: its arrival
    first_token_s: float | None = None
    finish_s: float | None = None
    # Scored prompt tokens (from the second) while SamplingParams.prompt_logprobs asks for them; None when it
    # does not, or once they were handed out with the first output token.
    prompt_logprobs: list | None = None

    @property
    def length_center_tokens(self) -> int | None:
        """What its length distribution is centred on: the latest prediction, else its current bound."""
        center = self.predicted_center_tokens
        return center if center is not None else self.predicted_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens the sequence can reach: prompt plus its generation limit."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    def token_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def tokens_between(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
