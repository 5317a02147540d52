"""Where the router gets a request's length prediction: in its own process, or from the predictor deployment.

    InRouterPredictor     the active predictor version inside each router replica: no extra hop.
                          The shipped LightGBM answers in ~0.3 ms; measured on the service, the hop
                          to a separate replica cost 5.5 ms idle and 77 ms p50 under a 32-request
                          burst on 2 cores, most of the router + predictor + placement overhead.
    DeploymentPredictor   the batched Serve deployment (`predictor_service.deployment`), for
                          predictors too heavy to run on the router's event loop (the MiniLM
                          transformer: ~12 ms a batch on CPU).

Both serve the version that LATEST names under the predictor root and switch when the
retraining task promotes a new one; a payload is {"prompt_id", "prompt_text",
"num_prompt_tokens", "max_tokens", "temperature"}, an answer {"point_tokens",
"upper_bound_tokens", "bucket_probs", "version"}.
"""

import abc
import time

PREDICTOR_MODES = ("router", "deployment")
RELOAD_CHECK_INTERVAL_S = 1.0  # a stat and a small JSON read, at most this often


class PredictorClient(abc.ABC):
    """The router's source of length predictions."""

    @abc.abstractmethod
    async def predict(self, payload: dict) -> dict:
        """One prediction; raises on failure (the router answers 503)."""


class InRouterPredictor(PredictorClient):
    """The predictor in this process.

    Args:
        artifact_root: the versions directory (LATEST), as the deployment would load it.
        quantile, max_len: settings of the fallback baseline when no artifact loads.
        model: the served model (`LengthPredictorServer`: the prior when the shipped artifact is of another).
    """

    def __init__(self, artifact_root: str | None, quantile: float, max_len: int, model: str | None = None) -> None:
        from predictor_service.server import LengthPredictorServer

        self.server = LengthPredictorServer(artifact_root, quantile, max_len, model=model)
        self._checked_s = time.monotonic()

    async def predict(self, payload: dict) -> dict:
        now_s = time.monotonic()
        if now_s - self._checked_s >= RELOAD_CHECK_INTERVAL_S:
            self._checked_s = now_s
            self.server.reload_if_promoted()
        return self.server.predict([payload])[0]


class DeploymentPredictor(PredictorClient):
    """A Serve handle to the batched predictor deployment."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def predict(self, payload: dict) -> dict:
        return await self.handle.predict.remote(payload)
