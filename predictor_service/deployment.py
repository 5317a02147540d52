"""Ray Serve deployment of the length predictor: batched calls, hot reload of promoted versions."""

from ray import serve

from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE
from predictor_service.server import LengthPredictorServer


# max_ongoing_requests >= max_batch_size, or batches could never fill.
@serve.deployment(name="length_predictor", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=128)
class PredictorDeployment:
    """Batches concurrent `predict` calls; each batch first checks whether a new version was promoted.

    Args:
        artifact_root: directory of predictor versions (LATEST), or None. Until it holds a version
            the shipped default artifact is served (the prompt-length baseline if that fails to load).
        quantile, max_len: settings of that baseline.
    """

    def __init__(self, artifact_root: str | None = None, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                 model: str | None = None) -> None:
        self.server = LengthPredictorServer(artifact_root, quantile, max_len, model=model)

    # A short wait: under load batches fill while the previous one runs; alone, a request should not wait.
    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0005)
    async def predict(self, payloads: list[dict]) -> list[dict]:
        self.server.reload_if_promoted()  # a stat and a small JSON read per batch
        return self.server.predict(payloads)

    def version(self) -> str:
        return self.server.version


def build_predictor_app(config: dict):
    """Application builder: {"artifact_root", "quantile", "max_len", "model"} -> bound deployment."""
    return PredictorDeployment.bind(config.get("artifact_root"), config.get("quantile", 0.9),
                                    config.get("max_len", 1024), config.get("model"))
