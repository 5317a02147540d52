"""`s3serve serve`: the service (`cluster.service`) with a ready message, run until Ctrl-C or SIGTERM."""

import json
import signal
import threading
from pathlib import Path

from cluster.config import ServiceConfig
from cluster.service import start_service, stop_service

def curl_example(base_url: str, model_id: str, api_key: str | None) -> str:
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Name three primary colors."}],
                       "max_tokens": 64})
    return f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def kv_summary(kv_tokens: list[int], max_model_len: int, kv_cache_memory: str = "auto") -> str:
    """The start-up line on KV room: the setting, tokens per worker and how many longest sequences fit in one at
    once."""
    if not kv_tokens:
        return f"KV cache ({kv_cache_memory}): no worker reported yet"
    least = min(kv_tokens)
    per = f"{least:,}" if least == max(kv_tokens) else f"{least:,} to {max(kv_tokens):,}"
    fits = least // max_model_len
    advice = "" if fits >= 1 else " (fewer than one: raise --kv-cache-memory or lower --max-model-len)"
    return (f"KV cache ({kv_cache_memory}): {per} tokens per worker, {fits} sequence(s) of max_model_len "
            f"{max_model_len:,} at once in the smallest{advice}")


def predictor_warning(config: ServiceConfig) -> str | None:
    """A line when the length predictor the routers serve learnt another model's output lengths, else None."""
    from predictor_service.artifacts import trained_for
    from predictor_service.server import DEFAULT_ARTIFACT_ROOT, latest_version_dir

    try:
        served = latest_version_dir(Path(config.predictor_root)) or DEFAULT_ARTIFACT_ROOT  # as the routers choose
        model = trained_for(served)
    except (ValueError, FileNotFoundError):
        return None  # the router says what it serves instead
    if model is None or model == config.model:
        return None
    calibrate = (f"`s3serve calibrate --model {config.model}` makes one for this model now (then pass "
                 "--predictor-artifact DIR/predictor)")
    if served == DEFAULT_ARTIFACT_ROOT:
        return (f"note: no length predictor for {config.model} yet (the shipped one learnt {model}'s lengths): the "
                "routers bound each request by its max_tokens until retraining on this service's traffic promotes "
                f"one; {calibrate}")
    return (f"warning: the length predictor ({served}) learnt {model}'s output lengths, not {config.model}'s, so its "
            f"bounds are another model's until retraining on this service's traffic replaces it; {calibrate}")


def run_service(config: ServiceConfig, ready_timeout_s: float = 900.0) -> int:
    """`s3serve serve`: run until Ctrl-C or SIGTERM; returns the exit code."""
    service = start_service(config, ready_timeout_s)
    try:
        config = service.config
        key = config.api_keys[0] if config.api_keys else None
        print(f"\nS3 Serve is ready at {service.base_url}  ({service.health['workers_ready']} worker(s), "
              f"policy {config.policy})")
        print("  " + kv_summary(list(service.health.get("kv_tokens", {}).values()), config.max_model_len,
                                config.kv_cache_memory))
        print(f"  OpenAI API: {service.base_url}/v1   metrics: {service.base_url}/metrics   "
              f"health: {service.base_url}/health")
        print(f"  dashboard:  {service.base_url}/dashboard" + ("#key=<your key>" if key else ""))
        warning = predictor_warning(config)
        if warning is not None:
            print("  " + warning)
        print("  try:\n    " + curl_example(service.base_url, config.model_id, key))
        print("Press Ctrl-C to stop.", flush=True)
        _wait_for_signal()
        print("\ns3serve: stopping", flush=True)
        return 0
    finally:
        stop_service(service)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
