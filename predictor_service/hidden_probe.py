"""A length probe on the served model's own hidden states: the worker-side predictor.

Input per row: the final-norm hidden state where the engine samples (standardised),
plus the decoded count, the prompt length and the tokens still allowed (log-scaled).
A small MLP (or a linear map, `hidden_units=0`) with two heads:

- quantiles of log(1 + remaining tokens) at 0.5 (the point estimate) and at
  `quantile` (the raw bound), trained with the pinball loss; the bound is then
  shifted by a split-conformal offset fitted on prompts kept out of training
  (`predictor_service.calibration`), so coverage holds on new prompts;
- the 10 equal-width buckets of the *total* output length (the S3 paper's
  classifier), trained with cross-entropy.

`ranking_weight > 0` adds a pairwise logistic ranking loss on the point head
within each mini-batch (ordering is what a scheduler consumes; vllm-ltr's result).

`cap_aware` treats an answer that runs to its `max_tokens` as censored: a third head
gives the chance p that the answer runs to the cap (binary cross-entropy on every row,
1 where the answer ran to it), the median head learns only the answers that stopped on their own, and the point
is the expected capped remainder, p x (tokens still allowed) + (1 - p) x min(allowed,
median). Past a few hundred decoded tokens most of the answers still going will run to
the cap, whose remainder the tokens still allowed give exactly.

Training rows are `predictor_service.hidden_features` rows: the engine's own, read by
`s3serve probe extract` at 0, 64, 128, ... decoded tokens, so one probe answers both the
first prediction after prefill and every re-prediction while decoding.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from predictor_service.calibration import BoundCalibration, fit_calibration, is_calibration_example
from predictor_service.hidden_features import HiddenFeatures
from predictor_service.length_predictor import LengthPrediction
from predictor_service.metrics import bucket_of
from predictor_service.probe_files import PROBE_MANIFEST_FILE, PROBE_WEIGHTS_FILE, ProbeConfig, is_probe_folder

DEFAULT_PROBE = Path(__file__).parent / "default_probe"  # trained on the shipped labels' features


@dataclass(frozen=True, slots=True)
class ProbeOutput:
    """Predictions for N rows: remaining tokens (point and calibrated bound) and total-length bucket probabilities."""

    point_remaining: np.ndarray  # [N] int64
    upper_remaining: np.ndarray  # [N] int64
    bucket_probs: np.ndarray  # [N, num_buckets]


class _ProbeNet(torch.nn.Module):
    def __init__(self, input_size: int, config: ProbeConfig) -> None:
        super().__init__()
        width = config.hidden_units
        self.trunk = (torch.nn.Sequential(torch.nn.Linear(input_size, width), torch.nn.GELU(),
                                          torch.nn.Dropout(config.dropout))
                      if width else torch.nn.Identity())
        self.quantiles = torch.nn.Linear(width or input_size, 2)  # log1p(remaining) at 0.5 and at `quantile`
        self.buckets = torch.nn.Linear(width or input_size, config.num_buckets)
        self.cap = torch.nn.Linear(width or input_size, 1) if config.cap_aware else None  # logit of running to the cap

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [N, input] -> quantiles [N, 2], bucket logits [N, num_buckets], cap logit [N] (cap_aware, else None)."""
        h = self.trunk(x)
        return self.quantiles(h), self.buckets(h), None if self.cap is None else self.cap(h)[:, 0]


def _side_features(num_prompt, num_output, max_tokens, max_len: int) -> np.ndarray:
    """[N, 3] log-scaled decoded count, prompt length and tokens still allowed."""
    scale = np.log1p(max_len)
    num_output = np.asarray(num_output, dtype=np.float64)
    return np.stack([np.log1p(num_output) / scale, np.log1p(np.asarray(num_prompt, dtype=np.float64)) / scale,
                     np.log1p(np.asarray(max_tokens, dtype=np.float64) - num_output) / scale], axis=1)


def _pinball(pred: torch.Tensor, target: torch.Tensor, tau: float) -> torch.Tensor:
    diff = target - pred
    return torch.mean(torch.maximum(tau * diff, (tau - 1) * diff))


def _pairwise_ranking(score: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean logistic loss over pairs whose true order is strict: score should follow target."""
    diff_true = target[:, None] - target[None, :]  # [B, B]
    diff_score = score[:, None] - score[None, :]
    mask = diff_true > 0
    if not mask.any():
        return score.sum() * 0.0
    return F.softplus(-diff_score[mask]).mean()


class HiddenStateProbe:
    """The trained probe: a predictor `bench predictor` scores, and the worker's `LengthProbe` once the
    cluster wraps it (`cluster.control.worker_probe`; this package imports nothing of the workers)."""

    name = "probe"

    def __init__(self, config: ProbeConfig, hidden_size: int) -> None:
        self.config = config
        self.interval_tokens = config.interval_tokens
        self.hidden_size = hidden_size
        torch.manual_seed(config.seed)
        self.net = _ProbeNet(hidden_size + 3, config).eval()
        self.mean = torch.zeros(hidden_size)
        self.std = torch.ones(hidden_size)
        self.calibration: BoundCalibration | None = None
        self.last_read_tokens: int | None = None  # the most decoded tokens of a training row; no reads past it

    def reads_at(self, num_output_tokens: int) -> bool:
        """Whether a sequence that has decoded `num_output_tokens` is read: every `interval_tokens` (0
        included), but never past the decoded counts the probe was trained on."""
        within = self.last_read_tokens is None or num_output_tokens <= self.last_read_tokens
        return within and num_output_tokens % self.interval_tokens == 0

    # -- inputs -------------------------------------------------------------

    def _inputs(self, hidden, num_prompt, num_output, max_tokens) -> torch.Tensor:
        # the engine's rows may sit on a GPU; the probe is small and runs on the host
        hidden = (hidden.detach().to("cpu", torch.float32) if torch.is_tensor(hidden)
                  else torch.as_tensor(np.asarray(hidden, dtype=np.float32)))
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [N, {self.hidden_size}], got {list(hidden.shape)}")
        side = torch.as_tensor(_side_features(num_prompt, num_output, max_tokens, self.config.max_len),
                               dtype=torch.float32)
        return torch.cat([(hidden - self.mean) / self.std, side], dim=1)  # [N, hidden_size + 3]

    # -- training -----------------------------------------------------------

    def fit(self, features: HiddenFeatures) -> "HiddenStateProbe":
        """Train on every row whose prompt is not in the calibration slice, then calibrate the bound on that slice."""
        if len(features) == 0:
            raise ValueError("cannot fit a probe on zero rows")
        if features.hidden.shape[1] != self.hidden_size:
            raise ValueError(f"features have hidden size {features.hidden.shape[1]}, the probe {self.hidden_size}")
        config = self.config
        calib = np.array([is_calibration_example(p, config.calibration_fraction) for p in features.prompt_ids])
        if calib.all() or not calib.any():
            calib = np.zeros(len(features), dtype=bool)  # too few prompts to set some aside: no calibration
        train = features.take(~calib)
        hidden = torch.as_tensor(train.hidden.astype(np.float32))
        self.mean = hidden.mean(0)
        self.std = hidden.std(0).clamp_min(1e-4)
        x = self._inputs(hidden, train.num_prompt_tokens, train.num_output_tokens, train.max_tokens)
        y = torch.as_tensor(np.log1p(train.remaining_tokens), dtype=torch.float32)  # [N]
        capped = torch.as_tensor(train.output_tokens >= train.max_tokens, dtype=torch.float32)  # [N]
        finished = capped == 0  # [N] the rows the median learns when cap_aware
        bucket = torch.as_tensor(bucket_of(train.output_tokens, config.max_len, config.num_buckets), dtype=torch.long)
        self.last_read_tokens = int(features.num_output_tokens.max())
        with torch.no_grad():  # start at the unconditional answer: pinball gradients are small and bounded
            self.net.quantiles.bias.copy_(torch.quantile(y, torch.tensor([0.5, config.quantile])))
            if self.net.cap is not None and finished.any():
                self.net.quantiles.bias[0] = torch.quantile(y[finished], 0.5)
                share = capped.mean().clamp(1e-3, 1 - 1e-3)
                self.net.cap.bias.fill_(float(torch.log(share / (1 - share))))
            prior = torch.bincount(bucket, minlength=config.num_buckets).float() + 1.0
            self.net.buckets.bias.copy_(torch.log(prior / prior.sum()))
        generator = torch.Generator().manual_seed(config.seed)
        optimizer = torch.optim.AdamW(self.net.parameters(), lr=config.learning_rate,
                                      weight_decay=config.weight_decay)
        self.net.train()
        for _ in range(config.num_epochs):
            order = torch.randperm(len(y), generator=generator)
            for start in range(0, len(y), config.batch_size):
                batch = order[start:start + config.batch_size]
                quantiles, logits, cap_logit = self.net(x[batch])
                median_rows = finished[batch] if cap_logit is not None else torch.ones_like(finished[batch])
                loss = (_pinball(quantiles[:, 1], y[batch], config.quantile)
                        + 0.2 * F.cross_entropy(logits, bucket[batch]))
                if median_rows.any():
                    loss = loss + _pinball(quantiles[median_rows, 0], y[batch][median_rows], 0.5)
                if cap_logit is not None:
                    loss = loss + F.binary_cross_entropy_with_logits(cap_logit, capped[batch])
                if config.ranking_weight > 0 and median_rows.sum() > 1:
                    loss = loss + config.ranking_weight * _pairwise_ranking(quantiles[median_rows, 0],
                                                                            y[batch][median_rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.net.eval()
        self.calibration = None
        if calib.any():
            held = features.take(calib)
            raw = self._raw(held.hidden, held.num_prompt_tokens, held.num_output_tokens, held.max_tokens)[1]
            self.calibration = fit_calibration(raw, held.remaining_tokens, config.quantile, "conformal_probe")
        return self

    # -- prediction ---------------------------------------------------------

    @torch.no_grad()
    def _raw(self, hidden, num_prompt, num_output, max_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Point and raw bound of the remaining tokens [N] each, bucket probabilities [N, num_buckets]."""
        quantiles, logits, cap_logit = self.net(self._inputs(hidden, num_prompt, num_output, max_tokens))
        remaining = np.expm1(quantiles.double().numpy()).clip(min=1.0)  # [N, 2]
        point = remaining[:, 0]
        if cap_logit is not None:  # the expected capped remainder
            allowed = np.asarray(max_tokens, dtype=np.float64) - np.asarray(num_output, dtype=np.float64)
            chance = torch.sigmoid(cap_logit.double()).numpy()
            point = chance * allowed + (1.0 - chance) * np.minimum(point, allowed)
        return point, remaining[:, 1], torch.softmax(logits.double(), dim=1).numpy()

    def predict_rows(self, hidden, num_prompt, num_output, max_tokens) -> ProbeOutput:
        """Predictions for rows of hidden states [N, hidden_size] and their per-row counts ([N] each)."""
        point, upper, probs = self._raw(hidden, num_prompt, num_output, max_tokens)
        if self.calibration is not None:
            upper = self.calibration.apply(upper)
        allowed = np.asarray(max_tokens, dtype=np.float64) - np.asarray(num_output, dtype=np.float64)
        point = np.clip(np.rint(point), 1, allowed).astype(np.int64)
        upper = np.clip(np.rint(upper), 1, allowed).astype(np.int64)
        return ProbeOutput(point, np.maximum(upper, point), probs)

    def predict_lengths(self, hidden, num_prompt, num_output, max_tokens) -> list[LengthPrediction]:
        """Total output lengths (decoded + remaining) as the text predictors report them."""
        out = self.predict_rows(hidden, num_prompt, num_output, max_tokens)
        done = np.asarray(num_output, dtype=np.int64)
        return [LengthPrediction(int(d + p), int(d + u), tuple(float(v) for v in probs))
                for d, p, u, probs in zip(done, out.point_remaining, out.upper_remaining, out.bucket_probs)]

    # -- files --------------------------------------------------------------

    def save(self, out_dir: Path | str, metrics: dict | None = None) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"net": self.net.state_dict(), "mean": self.mean, "std": self.std},
                   out_dir / PROBE_WEIGHTS_FILE)
        manifest = {"kind": "hidden_state_probe", "config": asdict(self.config), "hidden_size": self.hidden_size,
                    "last_read_tokens": self.last_read_tokens,
                    "calibration": None if self.calibration is None else self.calibration.to_dict(),
                    "metrics": metrics or {}}
        (out_dir / PROBE_MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return out_dir

    @classmethod
    def load(cls, path: Path | str) -> "HiddenStateProbe":
        path = Path(path)
        if not is_probe_folder(path):
            raise FileNotFoundError(f"{path} holds no hidden-state probe (expected {PROBE_MANIFEST_FILE} and "
                                    f"{PROBE_WEIGHTS_FILE}; train one with `s3serve probe train`)")
        manifest = json.loads((path / PROBE_MANIFEST_FILE).read_text(encoding="utf-8"))
        probe = cls(ProbeConfig(**manifest["config"]), int(manifest["hidden_size"]))
        state = torch.load(path / PROBE_WEIGHTS_FILE, weights_only=True)
        probe.net.load_state_dict(state["net"])
        probe.mean, probe.std = state["mean"], state["std"]
        probe.last_read_tokens = manifest.get("last_read_tokens")
        if manifest.get("calibration"):
            probe.calibration = BoundCalibration.from_dict(manifest["calibration"])
        return probe


def load_probe_for(spec: str, hidden_size: int) -> HiddenStateProbe:
    """The probe named by `spec` ("default": the shipped one, else a folder), checked against the model's width."""
    probe = HiddenStateProbe.load(DEFAULT_PROBE if spec == "default" else spec)
    if probe.hidden_size != hidden_size:
        raise ValueError(f"the length probe reads hidden states of size {probe.hidden_size}, the model has "
                         f"{hidden_size}: train one on this model's features (`s3serve probe extract` and `train`)")
    return probe
