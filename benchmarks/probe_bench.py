"""The hidden-state probe's rows of `bench predictor`: trained on the train side's features, scored on held-out ones.

At the prefill's sample (0 decoded tokens) a probe is scored like every text predictor
(`predictor_service.metrics.evaluate` on total lengths). While decoding it re-predicts:
after 64, 128 and 256 decoded tokens the MAE on *remaining* tokens of the sequences still
running is reported next to what the prefill estimate alone says then (its point minus
the tokens decoded, at least 1), for the probes and for the text predictors alike, with the
Kendall tau-b of those remaining-token estimates against the truth at 0, 64, 128 and 256
decoded tokens (what shortest-remaining-first ordering consumes).
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from predictor_service.hidden_features import HiddenFeatures
from predictor_service.hidden_probe import HiddenStateProbe, ProbeConfig
from predictor_service.length_predictor import LengthPrediction
from predictor_service.metrics import evaluate, kendall_tau, mae_tokens

REPREDICTION_POINTS = (64, 128, 256)
RANKING_POINTS = (0, *REPREDICTION_POINTS)  # decoded counts at which the remaining-token ranking is scored

# name -> what its ProbeConfig sets (probe_rank is the shipped probe's recipe)
PROBE_VARIANTS = {"probe_linear": {"hidden_units": 0}, "probe": {}, "probe_rank": {"ranking_weight": 1.0},
                  "probe_capped": {"ranking_weight": 1.0, "cap_aware": True}}


def remaining_mae(point_remaining, features: HiddenFeatures) -> float:
    return mae_tokens(point_remaining, features.remaining_tokens)


def remaining_tau(point_remaining, features: HiddenFeatures) -> float | None:
    """Kendall tau of remaining-token estimates against the true remaining tokens (None: under 3 rows)."""
    return kendall_tau(point_remaining, features.remaining_tokens) if len(features) >= 3 else None


def _prefill_guess(prefill_point_by_prompt: Mapping[str, int], at: HiddenFeatures) -> tuple[np.ndarray, HiddenFeatures]:
    """The remaining tokens the prefill's point estimate alone says (max(1, point - decoded)) and their rows."""
    known = np.array([p in prefill_point_by_prompt for p in at.prompt_ids], dtype=bool)
    rows = at.take(known)
    guess = np.maximum(1, np.array([prefill_point_by_prompt[p] for p in rows.prompt_ids], dtype=np.int64)
                       - rows.num_output_tokens)
    return guess, rows


def prefill_remaining_mae(prefill_point_by_prompt: Mapping[str, int], at: HiddenFeatures) -> float | None:
    """MAE on remaining tokens when the prefill's point estimate is all one has: max(1, point - decoded)."""
    guess, rows = _prefill_guess(prefill_point_by_prompt, at)
    return remaining_mae(guess, rows) if len(rows) else None


def _latency_ms(probe: HiddenStateProbe, rows: HiddenFeatures, batch_size: int, num_batches: int) -> dict:
    take = rows.take(np.arange(len(rows)) < batch_size)
    times_ms = []
    for _ in range(num_batches + 1):
        began = time.perf_counter()
        probe.predict_rows(take.hidden, take.num_prompt_tokens, take.num_output_tokens, take.max_tokens)
        times_ms.append((time.perf_counter() - began) * 1e3)
    times_ms = times_ms[1:]  # the first call warms up
    return {f"latency_p50_ms_batch{batch_size}": float(np.percentile(times_ms, 50)),
            f"latency_p99_ms_batch{batch_size}": float(np.percentile(times_ms, 99))}


@dataclass(slots=True)
class ProbeScores:
    """What `score_probes` found.

    Attributes:
        results: probe variant -> its metrics (the keys of the text predictors' rows, and re-prediction MAEs).
        sizes: train and held-out row and prompt counts.
        prefill_predictions: probe variant -> held-out prompt id -> its prediction at the prefill's sample.
    """

    results: dict[str, dict]
    sizes: dict[str, int]
    prefill_predictions: dict[str, dict[str, LengthPrediction]] = field(default_factory=dict)


def fit_probes(train: HiddenFeatures, max_len: int, quantile: float) -> dict[str, tuple[HiddenStateProbe, float]]:
    """Every probe variant fitted on `train`'s rows: name -> (probe, seconds its fit took)."""
    fitted = {}
    for name, settings in PROBE_VARIANTS.items():
        config = ProbeConfig(max_len=max_len, quantile=quantile, **settings)
        began = time.perf_counter()
        probe = HiddenStateProbe(config, train.hidden.shape[1]).fit(train)
        fitted[name] = (probe, time.perf_counter() - began)
    return fitted


def probe_metrics(probe: HiddenStateProbe, test: HiddenFeatures,
                  max_len: int) -> tuple[dict, dict[str, LengthPrediction]]:
    """One fitted probe on held-out rows: the text predictors' metrics at the prefill's rows, the raw bound's cost,
    and the remaining-token tau and MAE at every re-prediction point; with its prediction per prefill prompt."""
    at_prefill = test.take(test.num_output_tokens == 0)
    began = time.perf_counter()
    predictions = probe.predict_lengths(at_prefill.hidden, at_prefill.num_prompt_tokens,
                                        at_prefill.num_output_tokens, at_prefill.max_tokens)
    metrics = evaluate(predictions, at_prefill.output_tokens, max_len)
    metrics["predict_all_held_out_s"] = time.perf_counter() - began
    metrics["calibration"] = None if probe.calibration is None else probe.calibration.to_dict()
    raw = probe._raw(at_prefill.hidden, at_prefill.num_prompt_tokens, at_prefill.num_output_tokens,
                     at_prefill.max_tokens)[1]
    raw_upper = np.minimum(np.rint(raw), at_prefill.max_tokens)
    metrics["raw_under_reservation_rate"] = float(np.mean(at_prefill.output_tokens > raw_upper))
    metrics["raw_mean_over_reservation_tokens"] = float(np.mean(np.maximum(0, raw_upper - at_prefill.output_tokens)))
    by_prompt = dict(zip(at_prefill.prompt_ids.tolist(), predictions))
    prefill_points = {p: pred.point_tokens for p, pred in by_prompt.items()}
    for decoded in RANKING_POINTS:
        at = test.take(test.num_output_tokens == decoded)
        out = probe.predict_rows(at.hidden, at.num_prompt_tokens, at.num_output_tokens, at.max_tokens)
        metrics[f"remaining_tau_at_{decoded}"] = remaining_tau(out.point_remaining, at)
        if decoded in REPREDICTION_POINTS:
            metrics[f"remaining_mae_tokens_at_{decoded}"] = remaining_mae(out.point_remaining, at) if len(at) else None
            metrics[f"prefill_remaining_mae_tokens_at_{decoded}"] = prefill_remaining_mae(prefill_points, at)
            metrics[f"num_running_at_{decoded}"] = len(at)
    return metrics, by_prompt


def split_features(features: HiddenFeatures, is_held_out: Callable[[str], bool]) -> tuple[HiddenFeatures,
                                                                                          HiddenFeatures]:
    """(train, held-out) rows by prompt; refuses a split that leaves either side empty."""
    held = np.array([is_held_out(p) for p in features.prompt_ids], dtype=bool)
    train, test = features.take(~held), features.take(held)
    if len(train) == 0 or len(test) == 0:
        raise ValueError(f"the features split into {len(train)} train and {len(test)} held-out rows: need both")
    return train, test


def score_probes(features: HiddenFeatures, is_held_out: Callable[[str], bool], max_len: int, quantile: float,
                 num_latency_batches: int = 50) -> ProbeScores:
    """Train each probe variant on the train side's rows and score it on the held-out side's."""
    train, test = split_features(features, is_held_out)
    at_prefill = test.take(test.num_output_tokens == 0)
    scores = ProbeScores({}, {"num_train_rows": len(train), "num_held_out_rows": len(test),
                              "num_held_out_prompts": len(at_prefill)})
    for name, (probe, fit_s) in fit_probes(train, max_len, quantile).items():
        metrics, scores.prefill_predictions[name] = probe_metrics(probe, test, max_len)
        metrics["fit_s"] = fit_s
        for batch_size in (1, 32):
            metrics.update(_latency_ms(probe, at_prefill, batch_size, num_latency_batches))
        scores.results[name] = metrics
    return scores


def text_predictor_remaining(prefill_point_by_prompt: Mapping[str, int], features: HiddenFeatures,
                             is_held_out: Callable[[str], bool]) -> dict:
    """A text predictor's prefill estimate judged at the re-prediction points (it cannot re-predict)."""
    held = features.take(np.array([is_held_out(p) for p in features.prompt_ids], dtype=bool))
    out = {}
    for decoded in RANKING_POINTS:
        guess, rows = _prefill_guess(prefill_point_by_prompt, held.take(held.num_output_tokens == decoded))
        out[f"remaining_tau_at_{decoded}"] = remaining_tau(guess, rows)
        if decoded in REPREDICTION_POINTS:
            value = remaining_mae(guess, rows) if len(rows) else None
            out[f"remaining_mae_tokens_at_{decoded}"] = value
            out[f"prefill_remaining_mae_tokens_at_{decoded}"] = value
    return out
