"""--api-key (kserve_paged/auth.py) on a small app and --disable-access-log-for-endpoints
(kserve_paged/access_log.py). The walk over the real server's route table is in
tests/test_server_security.py."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from kserve_paged.access_log import SkipPaths, parse_paths
from kserve_paged.auth import APIKeyMiddleware, is_open

KEY = "s3cret-key"


def _app() -> FastAPI:
    app = FastAPI()
    for path in ("/health", "/v1/chat/completions", "/v1/messages", "/v2/models/m/infer",
                 "/v2/models/m/ready", "/v1/models/m"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_middleware(APIKeyMiddleware, api_key=KEY)
    return app


async def _get(path: str, method: str = "POST", **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.request(method, path, headers=headers)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_key_required_and_checked(anyio_backend: str) -> None:
    assert (await _get("/v1/chat/completions")).status_code == 401
    refused = await _get("/v1/chat/completions", authorization="Bearer wrong")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert (await _get("/v1/chat/completions", authorization=f"Bearer {KEY}")).status_code == 200
    assert (await _get("/v1/chat/completions", authorization=f"bearer {KEY}")).status_code == 200
    # x-api-key is the Anthropic client's header: accepted on the Messages route only.
    assert (await _get("/v1/chat/completions", **{"x-api-key": KEY})).status_code == 401
    assert (await _get("/v1/messages", **{"x-api-key": KEY})).status_code == 200
    anthropic = (await _get("/v1/messages")).json()
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "authentication_error"
    assert (await _get("/v2/models/m/infer")).json() == {
        "error": "missing or wrong API key: send it as 'Authorization: Bearer <key>'"}
    assert (await _get("/health", method="GET")).status_code == 200
    assert (await _get("/v2/models/m/ready", method="GET")).status_code == 200
    assert (await _get("/v1/models/m", method="GET")).status_code == 200
    assert (await _get("/v1/models/m", method="POST")).status_code == 401


def test_open_paths() -> None:
    for path in ("/health", "/ping", "/metrics", "/v2/health/ready", "/v2/models/x/ready",
                 "/v2/models/x/versions/2/ready"):
        assert is_open("GET", path), path
    for path in ("/v2/models/x/infer", "/v1/models", "/openai/v1/models", "/v1/models/x:predict",
                 "/v1/completions", "/tokenize", "/v2/models/x", "/docs", "/openapi.json"):
        assert not is_open("GET", path), path


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty API key"):
        APIKeyMiddleware(_app(), api_key="")


def test_access_records_of_listed_paths_are_dropped() -> None:
    skip = SkipPaths(parse_paths(" /health, /metrics ,,/ping"))
    assert skip.paths == {"/health", "/metrics", "/ping"}

    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert not skip.filter(record("/health"))
    assert not skip.filter(record("/metrics?x=1"))
    assert skip.filter(record("/v1/completions"))
    assert skip.filter(record("/healthz"))
