"""Output-length prediction: the interface shared by predictors and the scheduler's callers."""

from predictor_service.length_predictor import LengthPrediction, LengthPredictor, LengthQuery, bucket_edges

__all__ = ["LengthPrediction", "LengthPredictor", "LengthQuery", "bucket_edges"]
