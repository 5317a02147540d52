"""The text length predictors' kinds by name, importing nothing, so the command line offers them without loading any.

`predictor_service.training.make_predictor` builds each; `predictor_service.recipe` chooses among the
refittable ones by leave-one-source-out Kendall tau.
"""

CAPPED_LIGHTGBM = "lightgbm_capped"  # LightGBM pointing at the expected capped length (cap_aware)
TRAINABLE_KINDS = ("lightgbm", CAPPED_LIGHTGBM, "transformer", "mean", "linear")
REFITTABLE_KINDS = ("mean", "linear", "lightgbm", CAPPED_LIGHTGBM)  # refitted once per held-out source in seconds
# The recipe's candidates, the fallback first (taken when no two sources can be held out): prompt length alone, which
# ranks unseen sources better than the hashed-n-gram LightGBM on the shipped labels, then LightGBM.
CANDIDATE_KINDS = ("linear", "lightgbm")
