"""What the tests of a whole running service share: its controller's status, waiting for it to idle, OpenAI-shaped
errors, authenticated requests, fault-free reference answers and streams read back with their usage."""

import time

import httpx
import openai
import pytest
import ray

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE


def post(service, path: str, **kwargs) -> httpx.Response:
    """POST with the service's first API key (a `headers` argument adds to or overrides it)."""
    keys = service.config.api_keys
    headers = {**({"Authorization": f"Bearer {keys[0]}"} if keys else {}), **kwargs.pop("headers", {})}
    return httpx.post(f"{service.base_url}{path}", headers=headers, timeout=120, **kwargs)


def controller_status(service):
    controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
    return ray.get(controller.status.remote(), timeout=60)


def wait_idle(service, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = controller_status(service)
        if not any(status.reserved_blocks.values()) and all(s.num_running == 0 and s.num_waiting == 0
                                                              for s in status.stats):
            return
        time.sleep(0.25)
    pytest.fail(f"the service is not idle: {status}")


def wait_running(service, num_running: int, timeout_s: float = 60.0) -> None:
    """Until the workers' stats show `num_running` sequences running (all of them placed and prefilled)."""
    deadline = time.monotonic() + timeout_s
    while sum(s.num_running for s in controller_status(service).stats) < num_running:
        assert time.monotonic() < deadline, f"fewer than {num_running} running: {controller_status(service)}"
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    return error


def streamed_completion(client: openai.OpenAI, request: dict) -> tuple[str, int | None]:
    """A streamed completion's text and its usage's completion tokens (None: the stream ended without usage)."""
    text, usage = [], None
    for chunk in client.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return "".join(text), usage
