"""How a request picks tokens and when it stops: plain values, no torch (messages carry them across processes)."""

from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)
GRAMMAR_FORMATS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output (structured output), compiled by `workers.values.grammar`.

    Attributes:
        format: "json_schema" (a JSON schema as JSON text), "regex", "choice" (a JSON list of strings) or
            "grammar" (Lark, or llama.cpp's GBNF).
        text: the schema, pattern, choices or grammar.
    """

    format: str
    text: str

    def __post_init__(self) -> None:
        if self.format not in GRAMMAR_FORMATS or not isinstance(self.text, str):
            raise ValueError(f"a grammar is one of {', '.join(GRAMMAR_FORMATS)} given as text, got {self!r}")


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
        top_k: sample among the k most likely tokens; 0 (or -1, vLLM's spelling) keeps every token.
        min_p: drop tokens less likely than min_p times the most likely one; 0 keeps every token.
        presence_penalty: subtracted once from the logit of every token the output already holds (OpenAI's,
            in [-2, 2]).
        frequency_penalty: subtracted from a token's logit once per time the output holds it (OpenAI's).
        repetition_penalty: a token of the prompt or the output has its logit divided by this when positive
            and multiplied by it when negative (vLLM's and Hugging Face's); 1 changes nothing.
        min_tokens: no EOS and no `stop_token_ids` token is picked, and no stop ends the output, before this
            many tokens.
        stop_token_ids: tokens that end the output (finish reason "stop") besides EOS; the token is kept.
        logit_bias: (token id, bias) pairs added to those logits before anything else (OpenAI's, in [-100, 100]).
        logprobs: each output token comes with its log-probability and this many most likely alternatives
            (0 to MAX_LOGPROBS); None: none. The model's raw distribution (log-softmax of its logits, before
            bias, penalties and temperature), as vLLM reports by default.
        prompt_logprobs: the same for every prompt token after the first (scoring, OpenAI's `echo`); None: none.
            Such a request computes its whole prompt (no prefix-cache hits, no KV brought along by a move).
        grammar: the output must match it (structured output): tokens it does not allow are never picked, and
            the output ends ("stop") once it is complete and can grow no further, whatever ignore_eos and
            forced_output_tokens say; where min_tokens' bans would leave it no token, it wins. None: free text.
        skip_special_tokens: stop strings are matched in the text without special tokens (vLLM's default), or, when
            false, with them (the text the client then gets).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    forced_output_tokens: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    skip_special_tokens: bool = True

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
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 and -1 keep every token), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.logit_bias, tuple) or any(
                len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0 or not -100.0 <= pair[1] <= 100.0
                for pair in self.logit_bias):
            raise ValueError(f"logit_bias must be (token id >= 0, bias in [-100, 100]) pairs, got {self.logit_bias!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before a token is picked (bias, penalties, or min_tokens' bans)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps only part of the distribution beyond top_p (top_k or min_p)."""
        return self.top_k > 0 or self.min_p > 0.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
