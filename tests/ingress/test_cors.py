"""CORS: off by default (a preflight gets 405, as without it), Starlette's own for the configured origins."""

import fastapi
from fastapi.testclient import TestClient

from cluster.ingress.cors import install_cors

PREFLIGHT = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def make_app(origins: tuple[str, ...]) -> fastapi.FastAPI:
    app = fastapi.FastAPI()
    install_cors(app)

    @app.post("/v1/completions")
    async def completions():
        return {"ok": True}

    app.state.allowed_origins = origins  # what the router does once it has its config
    return app


def test_off_by_default():
    client = TestClient(make_app(()))
    assert client.options("/v1/completions", headers=PREFLIGHT).status_code == 405
    answer = client.post("/v1/completions", headers={"Origin": "https://app.example.com"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_configured_origin_passes_the_preflight_and_gets_its_header():
    client = TestClient(make_app(("https://app.example.com",)))
    preflight = client.options("/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = client.post("/v1/completions", headers={"Origin": "https://app.example.com"})
    assert answer.headers["access-control-allow-origin"] == "https://app.example.com"


def test_another_origin_is_refused_and_star_allows_any():
    other = {**PREFLIGHT, "Origin": "https://evil.example"}
    assert TestClient(make_app(("https://app.example.com",))).options("/v1/completions", headers=other).status_code == 400
    anyone = TestClient(make_app(("*",))).options("/v1/completions", headers=other)
    assert anyone.status_code == 200 and anyone.headers["access-control-allow-origin"] == "*"
