"""A v2 request naming a model version is the client's error (400), not KServe's 501: served
models have no versions (found by the fuzzing of every route, issue 37 part 5)."""

from __future__ import annotations

from tests.helpers.server import FakeEngine, client, ready, run


def test_a_model_version_is_a_400_in_v2_shape_and_plain_routes_still_answer():
    async def main() -> None:
        app, model, _ = await ready(FakeEngine())
        async with client(app) as c:
            for method, path in (("GET", "/v2/models/m?model_version=1"),
                                 ("GET", "/v2/models/m/versions/1"),
                                 ("POST", "/v2/models/m/versions/1/infer")):
                r = await c.request(method, path, json={} if method == "POST" else None)
                assert r.status_code == 400, (path, r.text)
                assert "model versions are not supported" in r.json()["error"]
            r = await c.get("/v2/models/m")
            assert r.status_code == 200 and r.json()["name"] == "m"
        model.stop_engine()
    run(main())
