"""--api-key on the assembled server (kserve_paged/server.py's install + KServe's routes): a walk
over the app's whole route table, so a route added later cannot be left open, and the gateway
flags' checks (kserve_paged/gateway.py)."""

from __future__ import annotations

import re

import pytest
from starlette.routing import Route

from kserve_paged.args import parse_args
from kserve_paged.auth import is_open
from kserve_paged.gateway import api_key, check_gateway_args, served_names
from kserve_paged.model_control import is_control_path
from tests.helpers.server import NAME, client, ready, run

KEY = "k-123"
# Every open route the server has, pinned: a new open route must be added here on purpose.
OPEN = {("GET", "/"), ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
        ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v2/health/live"),
        ("GET", "/v2/health/ready"), ("GET", "/v2/models/{model_name}/ready"),
        ("GET", "/v2/models/{model_name}/versions/{model_version}/ready"),
        ("GET", "/v1/models/{model_name}")}
PARAM = re.compile(r"\{(\w+)(:\w+)?\}")


def _flat(routes) -> list:
    """Routes with their full paths; included routers (FastAPI >= 0.16x keeps them as one
    entry) opened up."""
    out = []
    for route in routes:
        if hasattr(route, "effective_candidates"):
            out += _flat(route.effective_candidates())
        else:
            out.append(route)
    return out


def _routes(app) -> list[tuple[str, str, str]]:
    """(method, route path, a concrete path) of every HTTP route of the app."""
    values = {"model_name": NAME, "model_version": "1"}
    found = []
    for route in _flat(app.routes):
        assert isinstance(route, Route) or hasattr(route, "original_route"), (
            f"not a plain HTTP route: {route!r}")
        for method in sorted(route.methods or ()):
            if method == "HEAD":
                continue
            path = PARAM.sub(lambda m: values.get(m[1], "x"), route.path)
            found.append((method, route.path, path))
    return found


def test_every_route_but_health_readiness_and_metrics_needs_the_key():
    async def main() -> None:
        app, model, _ = await ready(api_key=KEY)
        routes = _routes(app)
        assert len(routes) > 30
        opened, controlled = set(), set()
        async with client(app) as c:
            for method, route, path in routes:
                bare = await c.request(method, path, json={})
                if is_control_path(path):  # their own key, off without it (model_control.py)
                    controlled.add(route)
                    inference_key = await c.request(method, path, json={}, headers={
                        "authorization": f"Bearer {KEY}"})
                    assert bare.status_code == inference_key.status_code == 403, route
                    continue
                if is_open(method, path):
                    opened.add((method, route))
                    assert bare.status_code != 401, (method, route)
                    continue
                assert bare.status_code == 401, (method, route, bare.status_code)
                assert bare.headers["www-authenticate"] == "Bearer"
                assert bare.json()["error"]  # JSON, in the route's protocol's shape
                wrong = await c.request(method, path, json={},
                                        headers={"authorization": "Bearer k-12"})
                assert wrong.status_code == 401, (method, route)
                good = await c.request(method, path, json={},
                                       headers={"authorization": f"Bearer {KEY}"})
                assert good.status_code != 401, (method, route)
                anthropic = await c.request(method, path, json={}, headers={"x-api-key": KEY})
                messages = path.startswith(("/v1/messages", "/openai/v1/messages"))
                assert (anthropic.status_code != 401) == messages, (method, route)
        assert opened == OPEN
        assert controlled == {"/v2/repository/models/{model_name}/load",
                              "/v2/repository/models/{model_name}/unload"}
        protected = {r for _, r, _ in routes} - {r for _, r in OPEN}
        for must in ("/v1/completions", "/v1/chat/completions", "/openai/v1/completions",
                     "/v2/models/{model_name}/infer", "/v1/models/{model_name}:predict",
                     "/tokenize", "/detokenize", "/v1/models", "/openai/v1/models",
                     "/openai/v1/load_lora_adapter", "/v2/models/{model_name}"):
            assert must in protected, must
        model.stop_engine()
    run(main())


def test_without_a_key_nothing_is_refused():
    async def main() -> None:
        app, model, _ = await ready()
        async with client(app) as c:
            r = await c.post("/v1/completions", json={"model": NAME, "prompt": "a",
                                                      "max_tokens": 1})
            assert r.status_code == 200
        model.stop_engine()
    run(main())


def test_the_key_comes_from_the_flag_or_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(parse_args([])) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_key(parse_args([])) == "from-env"
    assert api_key(parse_args(["--api-key", "flag"])) == "flag"


def test_served_names_put_the_models_own_first_once():
    args = parse_args(["--served-model-name", "a", "publishers/ns/models/a", "a"])
    assert args.model_name == "a" and served_names(args) == ["a", "publishers/ns/models/a"]
    assert served_names(parse_args(["--model_name", "b"])) == ["b"]


@pytest.mark.parametrize("argv, message", [
    (["--ssl-certfile", "{cert}"], "go together"),
    (["--ssl-keyfile", "{cert}"], "go together"),
    (["--ssl-ca-certs", "{cert}"], "--ssl-ca-certs needs"),
    (["--enable-ssl-refresh"], "--enable-ssl-refresh needs"),
    (["--ssl-certfile", "/no/cert", "--ssl-keyfile", "{cert}"], "/no/cert does not exist"),
    (["--collect-detailed-traces", "all"], "needs --otlp-traces-endpoint"),
    (["--otlp-traces-endpoint", "http://c:4317", "--collect-detailed-traces", "engine"],
     "unknown level"),
    (["--api-key", ""], "empty"),
    (["--api-key", "k", "--enable_grpc", "true"], "--enable_grpc false"),
])
def test_gateway_flags_that_cannot_work_are_refused_by_name(argv, message, tmp_path,
                                                            monkeypatch):
    monkeypatch.delenv("KSERVE_TLS_CERT_FILE", raising=False)
    monkeypatch.delenv("KSERVE_TLS_KEY_FILE", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    args = parse_args([a.format(cert=cert) for a in argv])
    assert message in (check_gateway_args(args) or "")


def test_coherent_gateway_flags_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")  # fine with gRPC off
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    args = parse_args(["--enable_grpc", "false",
                       "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert),
                       "--ssl-ca-certs", str(cert), "--enable-ssl-refresh",
                       "--otlp-traces-endpoint", "http://c:4317",
                       "--collect-detailed-traces", "model,worker"])
    assert check_gateway_args(args) is None


def test_access_log_flags_reach_uvicorn():
    import logging
    from types import SimpleNamespace

    import uvicorn

    from kserve_paged.access_log import ACCESS_LOGGER, SkipPaths
    from kserve_paged.gateway import RestOptions

    access = logging.getLogger(ACCESS_LOGGER)
    before = list(access.filters)
    try:
        options = RestOptions.from_args(parse_args([
            "--disable-access-log-for-endpoints", "/health,/metrics",
            "--disable-uvicorn-access-log"]))
        (skip,) = [f for f in access.filters if f not in before]
        assert isinstance(skip, SkipPaths) and skip.paths == {"/health", "/metrics"}
        config = uvicorn.Config(app=None)
        rest = SimpleNamespace(config=config, _server=uvicorn.Server(config))
        options.apply(rest)
        assert config.access_log is False and config.ssl_ca_certs is None
        assert RestOptions.from_args(parse_args([])).access_log is True
    finally:
        access.filters[:] = before
