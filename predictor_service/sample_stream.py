"""Finished requests as training samples on a Redis stream.

Key layout (one stream, capped at about `max_entries`, oldest trimmed first):

    s3:predictor:samples   XADD entries, fields:
        prompt_id, prompt_text, num_prompt_tokens, max_tokens, temperature,
        true_output_tokens, predicted_upper_bound_tokens ("" when none)

Entry ids are Redis stream ids ("<ms>-<seq>"), increasing; a reader keeps the
last id it saw and asks for what came after.
"""

from dataclasses import dataclass

from predictor_service.length_example import LengthExample

DEFAULT_STREAM_KEY = "s3:predictor:samples"


@dataclass(frozen=True, slots=True)
class TrainingSample:
    """A finished request: what the predictor saw, what it said, what happened."""

    prompt_id: str
    prompt_text: str
    num_prompt_tokens: int
    max_tokens: int
    temperature: float
    true_output_tokens: int
    # The estimate the request was planned by: the upper bound, or the point under a policy that takes
    # blocks on demand (s3_peak plans by the point, `PlanningRule.prediction_from`).
    predicted_upper_bound_tokens: int | None = None

    def example(self) -> LengthExample:
        return LengthExample(self.prompt_id, self.prompt_text, self.num_prompt_tokens, self.max_tokens,
                             self.temperature)


class SampleStream:
    """Append and read training samples on a Redis stream.

    Args:
        client: a `redis.Redis` connected to the service's Redis.
        key: stream key.
        max_entries: approximate cap; older samples are trimmed.
    """

    def __init__(self, client, key: str = DEFAULT_STREAM_KEY, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.client = client
        self.key = key
        self.max_entries = max_entries

    def append(self, sample: TrainingSample) -> str:
        """Add a sample; returns its stream id."""
        entry_id = self.client.xadd(self.key, sample_fields(sample), maxlen=self.max_entries, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def read(self, after_id: str = "0-0", count: int | None = None) -> list[tuple[str, TrainingSample]]:
        """Samples after `after_id`, oldest first."""
        entries = self.client.xrange(self.key, min=f"({after_id}" if after_id != "0-0" else "-", count=count)
        return [(_text(entry_id), _sample(fields)) for entry_id, fields in entries]

    def length(self) -> int:
        return int(self.client.xlen(self.key))


def sample_fields(sample: TrainingSample) -> dict:
    """A sample as stream entry fields (writers that batch the XADD with other commands use this)."""
    if sample.true_output_tokens < 1:
        raise ValueError(f"true_output_tokens must be >= 1, got {sample.true_output_tokens}")
    return {
        "prompt_id": sample.prompt_id,
        "prompt_text": sample.prompt_text,
        "num_prompt_tokens": sample.num_prompt_tokens,
        "max_tokens": sample.max_tokens,
        "temperature": sample.temperature,
        "true_output_tokens": sample.true_output_tokens,
        "predicted_upper_bound_tokens": "" if sample.predicted_upper_bound_tokens is None
        else sample.predicted_upper_bound_tokens,
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sample(fields: dict) -> TrainingSample:
    row = {_text(k): _text(v) for k, v in fields.items()}
    bound = row.get("predicted_upper_bound_tokens", "")
    return TrainingSample(
        prompt_id=row["prompt_id"],
        prompt_text=row["prompt_text"],
        num_prompt_tokens=int(row["num_prompt_tokens"]),
        max_tokens=int(row["max_tokens"]),
        temperature=float(row["temperature"]),
        true_output_tokens=int(row["true_output_tokens"]),
        predicted_upper_bound_tokens=int(bound) if bound else None,
    )
