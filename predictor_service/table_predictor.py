"""A benchmark instrument, not a product predictor: predictions looked up by prompt text.

Cluster benchmarks replay traces whose output lengths are forced and unrelated to the
prompt text, so no model can predict them. To measure the *scheduling* with a predictor of
known quality over the real HTTP path, the benchmark precomputes each prompt's prediction
(e.g. a noisy oracle) and ships them as this artifact kind; the service then serves it like
any other version. Unknown prompts get the safe answer: the request's max_tokens.
"""

import hashlib
from collections.abc import Sequence

from predictor_service.length_example import FittedLengthPredictor, LengthExample, clamp_tokens
from predictor_service.length_predictor import LengthPrediction


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class TableLengthPredictor(FittedLengthPredictor):
    """Predictions by prompt text.

    Args:
        entries: sha256 of the prompt text -> (point_tokens, upper_bound_tokens, bucket_probs).
        num_buckets: length of the bucket vector answered for unknown prompts.
    """

    name = "table"

    def __init__(self, entries: dict[str, tuple[int, int, tuple[float, ...]]] | None = None,
                 num_buckets: int = 10) -> None:
        super().__init__()
        self.entries = dict(entries or {})
        self.num_buckets = num_buckets

    @classmethod
    def from_predictions(cls, texts: Sequence[str], predictions: Sequence[LengthPrediction]) -> "TableLengthPredictor":
        if len(texts) != len(predictions):
            raise ValueError(f"got {len(texts)} texts for {len(predictions)} predictions")
        entries = {text_key(t): (p.point_tokens, p.upper_bound_tokens, tuple(p.bucket_probs))
                   for t, p in zip(texts, predictions)}
        num_buckets = len(predictions[0].bucket_probs) if predictions else 10
        return cls(entries, num_buckets)

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "TableLengthPredictor":
        """Remember the exact lengths (an oracle for exactly these prompts)."""
        if len(examples) != len(lengths):
            raise ValueError(f"got {len(examples)} examples for {len(lengths)} lengths")
        uniform = tuple([1.0 / self.num_buckets] * self.num_buckets)
        self.entries = {text_key(e.prompt_text): (int(n), int(n), uniform) for e, n in zip(examples, lengths)}
        return self

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        uniform = tuple([1.0 / self.num_buckets] * self.num_buckets)
        out = []
        for example in examples:
            point, upper, probs = self.entries.get(text_key(example.prompt_text),
                                                   (example.max_tokens, example.max_tokens, uniform))
            point_tokens = int(clamp_tokens([point], example.max_tokens)[0])
            upper_tokens = int(clamp_tokens([max(upper, point)], example.max_tokens)[0])
            out.append(LengthPrediction(point_tokens, upper_tokens, tuple(probs)))
        return out

    def to_params(self) -> dict:
        return {"num_buckets": self.num_buckets,
                "entries": {k: [p, u, list(b)] for k, (p, u, b) in self.entries.items()}}

    @classmethod
    def from_params(cls, params: dict) -> "TableLengthPredictor":
        try:
            entries = {k: (int(p), int(u), tuple(float(x) for x in b)) for k, (p, u, b) in params["entries"].items()}
            return cls(entries, int(params["num_buckets"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"table predictor params are malformed: {error}") from None
