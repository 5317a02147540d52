"""A prompt as the trained predictors see it, and the base class they share.

`LengthQuery` carries token ids, not text, but the learned features (hashed word
n-grams, MiniLM embeddings) need the text. A trained predictor therefore scores
`LengthExample`s, and answers `predict(queries)` through a `text_of(query)` callable
given to it (a prompt-id lookup in benchmarks, the tokenizer's decode in serving).
"""

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from predictor_service.calibration import BoundCalibration
from predictor_service.length_predictor import LengthPrediction, LengthPredictor, LengthQuery

TextOf = Callable[[LengthQuery], str]


def join_messages(messages: Sequence[Mapping[str, str]]) -> str:
    """A chat's message contents as one text: what the text predictors train on and read, in training and serving."""
    return "\n\n".join(message["content"] for message in messages)


def constrained_text(prompt_text: str, grammar_format: str | None) -> str:
    """What the text predictors read for a request whose output a grammar constrains (structured output, whose
    lengths differ from free text's): the prompt, then a line naming the kind of constraint, whose words become
    features of their own. The same text goes into the request's training sample, so retraining learns them."""
    if grammar_format is None:
        return prompt_text
    return f"{prompt_text}\n\n[structured output: {grammar_format.replace('_', ' ')}]"


@dataclass(frozen=True, slots=True)
class LengthExample:
    """One prompt with the request settings that shape its output length.

    Attributes:
        prompt_id: stable id of the prompt ("<file stem>:<native id>").
        prompt_text: the prompt's message contents joined.
        num_prompt_tokens: chat-templated prompt length in tokens.
        max_tokens: the request's generation limit; predictions never exceed it.
        temperature: sampling temperature.
    """

    prompt_id: str
    prompt_text: str
    num_prompt_tokens: int
    max_tokens: int
    temperature: float = 0.0


def clamp_tokens(values, max_tokens) -> np.ndarray:
    """Round to whole tokens inside [1, max_tokens] (per element when max_tokens is an array)."""
    return np.clip(np.rint(np.asarray(values, dtype=np.float64)), 1, np.asarray(max_tokens)).astype(np.int64)


class FittedLengthPredictor(LengthPredictor):
    """A predictor fitted on labelled examples.

    Subclasses implement `fit` and `predict_examples`; `predict` turns queries into
    examples with `text_of` (set it on the instance; predictors that ignore the text
    work without it). Predictors whose upper bound is conformally calibrated set
    `calibration` in `fit` (artifacts save and restore it).
    """

    needs_text: bool = False

    def __init__(self) -> None:
        self.text_of: TextOf | None = None
        self.calibration: BoundCalibration | None = None

    def calibrated_upper(self, raw_upper_tokens, max_tokens) -> np.ndarray:
        """Raw bounds clamped to [1, max_tokens], widened (or tightened) by the calibration when there is one."""
        raw = clamp_tokens(raw_upper_tokens, max_tokens)
        if self.calibration is None:
            return raw
        return clamp_tokens(self.calibration.apply(raw), max_tokens)

    @abc.abstractmethod
    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "FittedLengthPredictor":
        """Fit on examples and their true output lengths in tokens; returns self."""

    @abc.abstractmethod
    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        """One prediction per example, in order."""

    def predict(self, queries: list[LengthQuery]) -> list[LengthPrediction]:
        if self.needs_text and self.text_of is None:
            raise ValueError(f"predictor {self.name!r} needs prompt text: set its text_of(query) callable")
        examples = [
            LengthExample(
                prompt_id=query.prompt_id,
                prompt_text=self.text_of(query) if self.text_of is not None else "",
                num_prompt_tokens=len(query.prompt_token_ids),
                max_tokens=query.max_tokens,
                temperature=query.temperature,
            )
            for query in queries
        ]
        return self.predict_examples(examples)


def check_training_set(examples: Sequence[LengthExample], lengths: Sequence[int]) -> np.ndarray:
    """The lengths as an array, after checking they match the examples and are non-negative."""
    if len(examples) != len(lengths):
        raise ValueError(f"got {len(examples)} examples for {len(lengths)} lengths")
    if not examples:
        raise ValueError("cannot fit a predictor on zero examples")
    array = np.asarray(lengths, dtype=np.float64)
    if np.any(array < 0):
        raise ValueError(f"lengths must be >= 0, got min {array.min()}")
    return array
