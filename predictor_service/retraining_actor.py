"""The retraining task as a Ray actor: a thread running `Retrainer.run` beside the service.

The controller starts it (named, detached) with the service's Redis and the predictor's
artifact root; each attempt's outcome is exported to Redis, and a promoted version is
picked up by the predictor deployment's hot reload.
"""

import logging
import threading
from pathlib import Path

from predictor_service.retraining import RetrainConfig, Retrainer, RetrainOutcome, export_outcome
from predictor_service.sample_stream import SampleStream

logger = logging.getLogger(__name__)


class RetrainerActor:
    """Owns one retraining thread.

    Args:
        redis_url: the service's Redis (the sample stream lives there).
        artifact_root: where versions are written (LATEST is what the predictor serves).
        config: when and how to retrain.
        poll_s: how often the thread checks for new samples.
    """

    def __init__(self, redis_url: str, artifact_root: str, config: RetrainConfig, poll_s: float = 30.0) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.retrainer = Retrainer(SampleStream(self.client), Path(artifact_root), config)
        self.stop_event = threading.Event()
        self.num_attempts = 0
        self.thread = threading.Thread(target=self._run, args=(poll_s,), name="retrainer", daemon=True)
        self.thread.start()

    def _run(self, poll_s: float) -> None:
        while not self.stop_event.is_set():
            try:
                self.retrainer.run(self.stop_event, poll_s, self._export)
            except Exception:  # noqa: BLE001 - a failed attempt (e.g. Redis restarting) must not end the task
                logger.exception("retraining attempt failed; trying again in %.0f s", poll_s)
                self.stop_event.wait(poll_s)

    def _export(self, outcome: RetrainOutcome) -> None:
        self.num_attempts += 1
        export_outcome(self.client, outcome)
        logger.info("retraining: %s", outcome.reason)

    def attempts(self) -> int:
        return self.num_attempts

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
