"""Sampling settings of a request and the batched sampler."""

from dataclasses import dataclass

import torch


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


class Sampler:
    """Picks one token per row of logits, each row with its own settings and generator."""

    def __init__(self) -> None:
        self._generators: dict[object, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seq_ids: list, params: list[SamplingParams]) -> list[int]:
        """Sample from logits [num_seqs, vocab_size]; returns one token id per row."""
        # Greedy rows share one argmax; only sampled rows pay for softmax.
        token_ids = torch.argmax(logits, dim=-1).tolist()
        for row, (seq_id, row_params) in enumerate(zip(seq_ids, params)):
            if not row_params.is_greedy:
                token_ids[row] = self._sample_row(logits[row], seq_id, row_params)
        return token_ids

    def forget(self, seq_id) -> None:
        """Drop a finished sequence's generator."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id, seed: int | None) -> torch.Generator:
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator()
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            self._generators[seq_id] = generator
        return generator

    def _sample_row(self, logits: torch.Tensor, seq_id, params: SamplingParams) -> int:
        # logits: [vocab_size]
        probs = torch.softmax(logits.float() / params.temperature, dim=-1).cpu()
        if params.top_p < 1.0:
            sorted_probs, sorted_ids = torch.sort(probs, descending=True)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs[mass_before >= params.top_p] = 0.0  # the top token always survives
            probs = torch.zeros_like(probs).scatter_(0, sorted_ids, sorted_probs)
        choice = torch.multinomial(probs, 1, generator=self._generator(seq_id, params.seed))
        return int(choice)
