"""What an engine step returns and records: new tokens, finished requests' timings, the step's phase times."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings of a finished request, in `time.monotonic()` seconds."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class StepTimes:
    """Seconds the latest step spent in each phase (`bench engine` reports them).

    `forward_s` includes `attention_s`; model time is their difference.
    """

    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    attention_s: float = 0.0
    sample_s: float = 0.0
    postprocess_s: float = 0.0
    num_tokens: int = 0  # tokens in the forward
    num_sequences: int = 0  # sequences in the forward


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One new token of one sequence; `finish_reason` is set on its last token."""

    seq_id: str
    token_id: int
    finish_reason: str | None
    output_token_ids: tuple[int, ...] | None = None  # all of them, on the last token only
    metrics: RequestMetrics | None = None  # on the last token only

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
