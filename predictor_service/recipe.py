"""The text predictor's recipe, chosen where it matters: by Kendall tau on prompt sources it never trained on.

A random split scores a predictor on prompts like those it learnt from; the service's traffic
brings prompts from sources nobody trained on. So the retrainer (`predictor_service.retraining`)
and `s3serve calibrate` choose the kind they fit the same way: each candidate kind is fitted
with one source held out, for every source in turn, and scored by the tau-b of its point on that
source; the kind with the highest mean over sources is the recipe (the earlier kind on a tie).

A source is where prompts come from: a labels file's set when the caller knows it (`s3serve
calibrate` names them from the prompt ids), otherwise a cluster of similar prompts
(`prompt_clusters`: k-means over hashed word n-grams, seeded), so that holding one out still
asks how a kind ranks prompts unlike those it was fitted on. The service's own requests name no
source, so the retrainer clusters them.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictor_service.features import FeatureConfig, hashed_ngrams
from predictor_service.kinds import CAPPED_LIGHTGBM, REFITTABLE_KINDS
from predictor_service.length_example import FittedLengthPredictor, LengthExample
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE
from predictor_service.lightgbm_predictor import BoosterConfig
from predictor_service.metrics import kendall_tau
from predictor_service.training import make_predictor

MIN_SOURCE_PROMPTS = 30  # fewest prompts of a source that it is held out and scored on (bench predictor's too)
MAX_CLUSTERS = 8  # sources made by clustering, at most
# A fold's LightGBM needs only its point: no conformal folds for the bound, one round of the bucket classifier.
FOLD_BOOSTERS = BoosterConfig(num_bucket_rounds=1, num_calibration_folds=0)


@dataclass(frozen=True, slots=True)
class RecipeScore:
    """A kind's leave-one-source-out score.

    Attributes:
        kind: the predictor kind.
        mean_tau: the unweighted mean over held-out sources of the tau-b of the point; None when no source could be
            held out (fewer than two sources of `MIN_SOURCE_PROMPTS` prompts).
        tau_by_source: source -> tau-b of the fit that did not see it.
        why_none: why there is no score, when there is none.
    """

    kind: str
    mean_tau: float | None
    tau_by_source: dict[str, float]
    why_none: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source_tau": self.mean_tau, "source_tau_by_source": dict(self.tau_by_source),
                **({} if self.why_none is None else {"why_no_source_tau": self.why_none})}


def kind_of(predictor: FittedLengthPredictor) -> str:
    """The kind a fitted predictor was made as (a cap-aware LightGBM saves as "lightgbm" with cap_aware set)."""
    return CAPPED_LIGHTGBM if getattr(predictor, "cap_aware", False) else predictor.name


def prompt_clusters(texts: Sequence[str], num_clusters: int, num_dims: int = 256, seed: int = 0,
                    num_starts: int = 8, num_iterations: int = 25) -> list[str]:
    """A source name per text ("cluster-0", ...): k-means over the L2-normalised log counts of each text's hashed
    word uni- and bi-grams (the words the text predictors read); of `num_starts` seeded k-means++ starts, the one with
    the least within-cluster distance."""
    if num_clusters < 1 or not texts:
        raise ValueError(f"clustering needs texts and num_clusters >= 1, got {len(texts)} texts, {num_clusters}")
    points = np.log1p(np.stack([hashed_ngrams(text, num_dims) for text in texts])).astype(np.float64)  # [N, D]
    points /= np.maximum(np.linalg.norm(points, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(num_starts):
        assignment, inertia = _kmeans(points, min(num_clusters, len(points)), rng, num_iterations)
        if inertia < best_inertia - 1e-9:
            best, best_inertia = assignment, inertia
    return [f"cluster-{c}" for c in best]


def _kmeans(points: np.ndarray, k: int, rng: np.random.Generator, num_iterations: int) -> tuple[np.ndarray, float]:
    """points [N, D] -> (cluster of each point [N], within-cluster squared distance), from a k-means++ start."""
    centres = points[[int(rng.integers(len(points)))]]  # [1, D]
    while len(centres) < k:
        distance = np.maximum(_squared_distances(points, centres).min(axis=1), 0.0)  # [N]
        if distance.sum() <= 0:
            break
        centres = np.vstack([centres, points[rng.choice(len(points), p=distance / distance.sum())]])
    assignment = np.argmin(_squared_distances(points, centres), axis=1)  # [N]
    for _ in range(num_iterations):
        centres = np.stack([points[assignment == c].mean(0) if np.any(assignment == c) else centres[c]
                            for c in range(len(centres))])
        moved, assignment = assignment, np.argmin(_squared_distances(points, centres), axis=1)
        if np.array_equal(moved, assignment):
            break
    distances = _squared_distances(points, centres)
    return assignment, float(distances[np.arange(len(points)), assignment].sum())


def _squared_distances(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """points [N, D], centres [K, D] -> [N, K] squared Euclidean distances."""
    return (points ** 2).sum(1)[:, None] + (centres ** 2).sum(1)[None, :] - 2.0 * points @ centres.T


def holdout_sources(examples: Sequence[LengthExample], named: Sequence[str] | None = None,
                    min_source_prompts: int = MIN_SOURCE_PROMPTS, num_hash_dims: int = 256) -> list[str]:
    """The source of each example: `named` when at least two of its sources have `min_source_prompts` prompts,
    otherwise clusters of the prompts (as many as give each about twice that many prompts, 2 to `MAX_CLUSTERS`) over
    the `num_hash_dims` hashed word columns the text predictors read."""
    if min_source_prompts < 1 or not examples:
        raise ValueError(f"holding out sources needs examples and min_source_prompts >= 1, got {len(examples)} "
                         f"examples, {min_source_prompts}")
    if named is not None:
        if len(named) != len(examples):
            raise ValueError(f"got {len(named)} source names for {len(examples)} examples")
        if sum(n >= min_source_prompts for n in _prompts_per_source(examples, named).values()) >= 2:
            return list(named)
    texts = {}  # each prompt once, in order (sampled labels repeat a prompt)
    for example in examples:
        texts.setdefault(example.prompt_id, example.prompt_text)
    num_clusters = max(2, min(MAX_CLUSTERS, len(texts) // (2 * min_source_prompts)))
    by_prompt = dict(zip(texts, prompt_clusters(list(texts.values()), num_clusters, num_hash_dims)))
    return [by_prompt[e.prompt_id] for e in examples]


def leave_source_out_tau(kind: str, examples: Sequence[LengthExample], lengths: Sequence[int],
                         sources: Sequence[str], quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                         feature_config: FeatureConfig | None = None,
                         min_source_prompts: int = MIN_SOURCE_PROMPTS) -> RecipeScore:
    """Fit `kind` without each source of `min_source_prompts` prompts in turn and score tau-b on it (see the module
    docstring); smaller sources are always trained on. A kind that cannot be fitted without some source (a cap-aware
    LightGBM whose training answers all stop, say) has no score."""
    if not len(examples) == len(lengths) == len(sources):
        raise ValueError(f"got {len(examples)} examples, {len(lengths)} lengths and {len(sources)} sources")
    sizes = _prompts_per_source(examples, sources)
    held_out = sorted(s for s, n in sizes.items() if n >= min_source_prompts)
    if len(held_out) < 2:
        return RecipeScore(kind, None, {}, f"fewer than two sources of {min_source_prompts} prompts to hold out")
    lengths = np.asarray(lengths)
    sources = np.asarray(sources)
    tau_by_source = {}
    for source in held_out:
        train = np.flatnonzero(sources != source)
        test = np.flatnonzero(sources == source)
        predictor = make_predictor(kind, quantile, max_len, feature_config, booster_config=FOLD_BOOSTERS)
        try:
            predictor.fit([examples[i] for i in train], lengths[train].tolist())
        except ValueError as error:
            return RecipeScore(kind, None, {}, f"cannot be fitted without {source}: {error}")
        points = [p.point_tokens for p in predictor.predict_examples([examples[i] for i in test])]
        tau_by_source[source] = kendall_tau(points, lengths[test])
    return RecipeScore(kind, float(np.mean(list(tau_by_source.values()))), tau_by_source)


def choose_recipe(kinds: Sequence[str], examples: Sequence[LengthExample], lengths: Sequence[int],
                  sources: Sequence[str], quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                  feature_config: FeatureConfig | None = None,
                  min_source_prompts: int = MIN_SOURCE_PROMPTS) -> tuple[RecipeScore, dict[str, RecipeScore]]:
    """(the best kind's score, every kind's score): the highest leave-source-out tau, the first kind on a tie or when
    no source could be held out."""
    if not kinds:
        raise ValueError("no candidate kind to choose from")
    scores = {kind: leave_source_out_tau(kind, examples, lengths, sources, quantile, max_len, feature_config,
                                         min_source_prompts) for kind in kinds}
    best = max(scores.values(), key=lambda s: (-np.inf if s.mean_tau is None else s.mean_tau,
                                               -list(kinds).index(s.kind)))
    return best, scores


def _prompts_per_source(examples: Sequence[LengthExample], sources: Sequence[str]) -> Counter:
    """Source -> distinct prompts (sampled labels repeat a prompt)."""
    return Counter(source for _, source in {(e.prompt_id, s) for e, s in zip(examples, sources)})
