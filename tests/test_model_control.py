"""Issue 49 item 9: KServe's model repository routes (`POST /v2/repository/models/{name}/load`
and `/unload`) are model control, apart from inference: off by default (403, whatever key is
sent), and with --model_control_key they answer to that key alone, never the inference key
(kserve_paged/model_control.py)."""

from __future__ import annotations

import asyncio

import pytest
from grpc import StatusCode
from kserve.model_repository import ModelRepository

from kserve_paged.args import parse_args
from kserve_paged.gateway import check_gateway_args, model_control_key
from kserve_paged.model_control import ModelControl, ModelControlOff
from tests.helpers.server import NAME, client, ready, run

KEY = "inference-key"
CONTROL = "control-key"
UNLOAD = f"/v2/repository/models/{NAME}/unload"
LOAD = f"/v2/repository/models/{NAME}/load"
BODY = {"model": NAME, "prompt": "a b", "max_tokens": 2}


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("install", [{"api_key": KEY}, {}], ids=["api-key", "no-key"])
def test_the_inference_key_cannot_unload_the_model_and_stop_it_for_everyone(install):
    async def main() -> None:
        app, model, _ = await ready(**install)
        headers = _bearer(KEY) if install else {}
        async with client(app) as c:
            for path in (UNLOAD, LOAD, "/v2/repository/index"):
                r = await c.post(path, headers=headers)
                assert r.status_code == 403, (path, r.text)
                assert "--model_control_key" in r.json()["error"]
            assert (await c.get(f"/v2/models/{NAME}/ready")).status_code == 200
            r = await c.post("/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 200, r.text
        assert model.accepting
        model.stop_engine()
    run(main())


def test_with_a_model_control_key_only_that_key_loads_and_unloads():
    async def main() -> None:
        app, model, _ = await ready(api_key=KEY, model_control_key=CONTROL)
        async with client(app) as c:
            for headers in ({}, _bearer(KEY), _bearer(CONTROL + "x"), {"x-api-key": CONTROL}):
                r = await c.post(UNLOAD, headers=headers)
                assert r.status_code == 401, (headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
            assert model.accepting
            r = await c.post(LOAD, headers=_bearer(CONTROL))
            assert r.status_code == 200 and r.json() == {"name": NAME, "load": True}, r.text
            # The control key is no inference key.
            r = await c.post("/v1/completions", json=BODY, headers=_bearer(CONTROL))
            assert r.status_code == 401
            r = await c.post(UNLOAD, headers=_bearer(CONTROL))
            assert r.status_code == 200 and r.json() == {"name": NAME, "unload": True}, r.text
            # KServe's unload: the model stops until a restart (what the key holder asked).
            assert (await c.get(f"/v2/models/{NAME}/ready")).status_code != 200
        assert not model.accepting
    run(main())


def test_the_repository_extension_refuses_while_control_is_off():
    """What gRPC's RepositoryModelLoad/Unload reach (KServe's gRPC server has no
    authentication): PERMISSION_DENIED, and nothing is unloaded."""
    class Stub:
        engine = False
        stopped = False

        def stop(self) -> None:
            self.stopped = True

        async def healthy(self) -> bool:
            return True

    registry = ModelRepository()
    model = Stub()
    registry.update(model, NAME)
    off = ModelControl(registry, None, enabled=False)
    for call in (off.load, off.unload):
        with pytest.raises(ModelControlOff) as refused:
            asyncio.run(call(NAME))
        assert refused.value.status_code == StatusCode.PERMISSION_DENIED
    assert registry.get_model(NAME) is model and not model.stopped
    on = ModelControl(registry, None, enabled=True)
    asyncio.run(on.unload(NAME))
    assert registry.get_model(NAME) is None and model.stopped


@pytest.mark.parametrize("argv, message", [
    (["--model-control-key", "", "--enable_grpc", "false"], "empty"),
    (["--model-control-key", "same", "--api-key", "same", "--enable_grpc", "false"],
     "a key of its own"),
    (["--model-control-key", "c"], "--enable_grpc false"),
])
def test_model_control_keys_that_cannot_work_are_refused(argv, message, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("KSERVE_PAGED_MODEL_CONTROL_KEY", raising=False)
    assert message in (check_gateway_args(parse_args(argv)) or "")


def test_the_model_control_key_comes_from_the_flag_or_its_variable(monkeypatch):
    monkeypatch.delenv("KSERVE_PAGED_MODEL_CONTROL_KEY", raising=False)
    assert model_control_key(parse_args([])) is None
    monkeypatch.setenv("KSERVE_PAGED_MODEL_CONTROL_KEY", "from-env")
    args = parse_args(["--enable_grpc", "false"])
    assert model_control_key(args) == "from-env" and check_gateway_args(args) is None
    assert model_control_key(parse_args(["--model-control-key", "flag"])) == "flag"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # the same key as the inference key
    assert "of its own" in check_gateway_args(parse_args(["--enable_grpc", "false"]))


def test_the_document_names_the_refusals():
    from tests.helpers.server import FakeEngine, build

    app, _ = build(engine=FakeEngine())
    paths = app.openapi()["paths"]
    for action in ("load", "unload"):
        assert {"401", "403"} <= set(paths[f"/v2/repository/models/{{model_name}}/{action}"][
            "post"]["responses"])
    assert "403" not in paths["/v2/models/{model_name}/infer"]["post"]["responses"]
