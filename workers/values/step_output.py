"""What an engine step returns and records: new tokens, finished requests' timings, the step's phase times
and shape (what it computed, for step-time models)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model's raw next-token distribution (log-softmax of the logits),
    with the most likely tokens of that distribution, most likely first: (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings of a finished request, in `time.monotonic()` seconds."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    admitted_s: float | None = None  # when it first left the worker's queue (None: no clock was given)
    num_cached_prompt_tokens: int = 0  # of its prompt, found in the prefix cache when first admitted

    @property
    def queue_s(self) -> float | None:
        """Seconds it waited in the worker's queue before it was first admitted."""
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

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
    logprob: TokenLogprob | None = None  # with SamplingParams.logprobs
    # with SamplingParams.prompt_logprobs, on the first token: one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes.

    Attributes:
        num_seqs: sequences with a chunk in the step.
        num_tokens: tokens computed (prefill chunks plus one per decode).
        num_context_tokens: tokens attended over, summed over chunks (each chunk's whole context).
        num_attention_pairs: (query token, key token) pairs, summed over chunks (attention FLOPs).
    """

    num_seqs: int
    num_tokens: int
    num_context_tokens: int
    num_attention_pairs: int


def step_shape(chunks) -> StepShape:
    """The `StepShape` of a scheduler step (`workers.scheduling.scheduler.ScheduledChunk`s, before they run)."""
    num_tokens = num_context = num_pairs = 0
    for chunk in chunks:
        start, n = chunk.seq.num_computed_tokens, chunk.num_tokens
        end = start + n
        num_tokens += n
        num_context += end
        num_pairs += n * start + n * (n + 1) // 2  # causal: query i sees start + i + 1 keys
    return StepShape(len(chunks), num_tokens, num_context, num_pairs)
