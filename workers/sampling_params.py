"""How a request picks tokens and when it stops: plain values, no torch (messages carry them across processes)."""

from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
            Below 1e-5 it is treated as greedy (dividing by less overflows fp32).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        seed: seeds this request's own generator, so its samples do not
            depend on what else is in the batch; None draws a random seed.
        stop: strings that end generation when they appear in the output.
        ignore_eos: keep going past EOS, so only `max_tokens` or a stop
            string ends the output (benchmarks force lengths this way).
        forced_output_tokens: benchmarks only: finish after exactly this many
            tokens, ignoring EOS, while `max_tokens` still states the request's
            limit (what a worst-case reservation reserves).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    forced_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.forced_output_tokens is not None and not 1 <= self.forced_output_tokens <= self.max_tokens:
            raise ValueError(
                f"forced_output_tokens must be in [1, max_tokens={self.max_tokens}], got {self.forced_output_tokens!r}"
            )
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
