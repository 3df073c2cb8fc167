"""Issue 37 part 5: /openapi.json documents every route's errors in the shape it answers them,
so the fuzz test (tests/helpers/fuzz.py) can hold every route to its document."""

from __future__ import annotations

from tests.helpers.server import FakeEngine, build


def test_every_route_documents_its_errors_and_no_422():
    app, _ = build(engine=FakeEngine(), lora_runtime_updates=True)
    doc = app.openapi()
    paths = doc["paths"]
    infer = paths["/v2/models/{model_name}/infer"]["post"]["responses"]
    assert "422" not in infer
    assert {"400", "404", "408", "413", "429", "503"} <= set(infer)
    assert infer["429"]["content"]["application/json"]["schema"]["properties"]["error"] == {
        "type": "string"}
    for route in ("/openai/v1/load_lora_adapter", "/openai/v1/unload_lora_adapter"):
        op = paths[route]["post"]
        assert "lora_name" in op["requestBody"]["content"]["application/json"]["schema"][
            "required"]
        assert {"200", "400", "404"} <= set(op["responses"])
    cmpl = paths["/openai/v1/completions"]["post"]
    assert {"408", "429"} <= set(cmpl["responses"])
    timeout = cmpl["requestBody"]["content"]["application/json"]["schema"]["properties"][
        "timeout"]
    assert timeout["anyOf"][0]["exclusiveMinimum"] == 0
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert not any("422" in op.get("responses", {}) for ops in paths.values()
                   for op in ops.values() if isinstance(op, dict))
