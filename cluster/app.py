"""The Serve application builder: `cluster.app:build_app` starts the whole service from a config dict.

`s3serve serve`, `deploy/serve_config.yaml` (`import_path: cluster.app:build_app`) and a
KubeRay RayService all go through here. The router creates the controller on first use,
and the controller starts the workers; so one `serve.run` brings up everything. The
length predictor runs inside the router unless `predictor_mode` asks for its own
deployment (`cluster/ingress/predictor_client.py` says when each fits).
"""

from cluster.config import ServiceConfig
from cluster.context_length import resolve_max_model_len
from cluster.control.redis_host import ensure_redis
from cluster.ingress.router import build_router
from predictor_service.deployment import PredictorDeployment
from workers.scheduling.policies import length_range_tokens


def build_app(args: dict):
    """Serve application for `args` (ServiceConfig fields); Redis from the config, $S3_REDIS_URL or embedded."""
    config, _ = resolve_max_model_len(ServiceConfig(**(args or {})))  # one number for routers and workers
    redis_url = config.redis_url_resolved or ensure_redis(config.data_dir)
    # Until the root holds a version (configured, or retrained from traffic) the shipped default is served.
    predictor = None
    if config.predictor_mode == "deployment":
        predictor = PredictorDeployment.bind(config.predictor_root, config.quantile,
                                             length_range_tokens(config.max_model_len), config.model)
    return build_router(config, redis_url, predictor)
