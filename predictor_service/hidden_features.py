"""Training rows for the hidden-state probe: (prompt, decoded count) -> the engine's hidden state.

The probe (`predictor_service.hidden_probe`) reads the final-norm hidden state of the
row the engine samples from, so its training rows must be those very vectors. They are
recorded by running the serving engine itself over labelled prompts (`s3serve probe
extract`, `s3serve_cli.probe_features`: labelling needs the engine, so it lives with the
CLI); this module holds what that writes and the probe trains on.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class HiddenFeatures:
    """Rows of (prompt, decoded count) -> hidden state, with what the target needs.

    Attributes:
        prompt_ids: [R] the prompt of each row.
        num_prompt_tokens, num_output_tokens, max_tokens, output_tokens: [R] int64; num_output_tokens is the
            count decoded when the row was read, output_tokens the label's final length.
        hidden: [R, hidden_size] float16 (the engine computes bf16 or fp32; fp16 keeps the file small).
        meta: model, max_len, interval and last checkpoint of the extraction.
    """

    prompt_ids: np.ndarray
    num_prompt_tokens: np.ndarray
    num_output_tokens: np.ndarray
    max_tokens: np.ndarray
    output_tokens: np.ndarray
    hidden: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining_tokens(self) -> np.ndarray:
        """[R] tokens still to come at each row, the one being sampled included."""
        return self.output_tokens - self.num_output_tokens

    def take(self, mask: np.ndarray) -> "HiddenFeatures":
        return HiddenFeatures(self.prompt_ids[mask], self.num_prompt_tokens[mask], self.num_output_tokens[mask],
                              self.max_tokens[mask], self.output_tokens[mask], self.hidden[mask], dict(self.meta))

    @classmethod
    def concatenate(cls, parts: "list[HiddenFeatures]") -> "HiddenFeatures":
        """The rows of several files as one (the meta of the first; they must agree on max_len and hidden size)."""
        if not parts:
            raise ValueError("no hidden-state features to join")
        for part in parts[1:]:
            if part.meta.get("model") != parts[0].meta.get("model"):
                raise ValueError(f"hidden-state features of {part.meta.get('model')} cannot join those of "
                                 f"{parts[0].meta.get('model')}: a probe reads one model's states")
            if (part.meta.get("max_len") != parts[0].meta.get("max_len")
                    or part.hidden.shape[1:] != parts[0].hidden.shape[1:]):
                raise ValueError(f"hidden-state features of max_len {part.meta.get('max_len')} and hidden size "
                                 f"{part.hidden.shape[1:]} cannot join those of max_len {parts[0].meta.get('max_len')} "
                                 f"and hidden size {parts[0].hidden.shape[1:]}")
        return cls(*(np.concatenate([getattr(part, name) for part in parts])
                     for name in ("prompt_ids", "num_prompt_tokens", "num_output_tokens", "max_tokens",
                                  "output_tokens", "hidden")), dict(parts[0].meta))

    def save(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, prompt_ids=self.prompt_ids.astype(str), num_prompt_tokens=self.num_prompt_tokens,
                            num_output_tokens=self.num_output_tokens, max_tokens=self.max_tokens,
                            output_tokens=self.output_tokens, hidden=self.hidden,
                            meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: Path | str) -> "HiddenFeatures":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"hidden-state features file {path} does not exist (make it with "
                                    "`s3serve probe extract`)")
        with np.load(path, allow_pickle=False) as data:
            return cls(data["prompt_ids"], data["num_prompt_tokens"], data["num_output_tokens"], data["max_tokens"],
                       data["output_tokens"], data["hidden"], json.loads(str(data["meta"])))
