"""Issue 37 part 5: /openapi.json documents every route's errors in the shape it answers them,
so the fuzz test (tests/helpers/fuzz.py) can hold every route to its document; the Responses
and Messages routes publish the schemas of the pydantic bodies that validate them."""

from __future__ import annotations

import jsonschema
import pydantic
import pytest

from kserve_paged.anthropic.body import CountTokensBody, MessagesBody
from kserve_paged.openai.responses_body import ResponsesBody
from tests.helpers.fuzz import FUZZ_CAPS, _cap_samples
from tests.helpers.server import FakeEngine, build, client, run


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


ASK = [{"role": "user", "content": "hello"}]


async def _served() -> dict:
    """/openapi.json as the server answers it."""
    app, _ = build(engine=FakeEngine())
    async with client(app) as c:
        return (await c.get("/openapi.json")).json()


def test_responses_and_messages_publish_the_bodies_their_handlers_validate():
    """/openapi.json, as served, gives each SDK route the schema of its pydantic body
    (responses_body.py, anthropic/body.py): its required fields, every field it takes and no
    other, and the shapes the handlers accept (a string where the SDK takes a string or
    parts) valid under it, catch-all members and all."""
    paths = run(_served())["paths"]

    def body_schema(path: str) -> dict:
        return paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    for path, body, required in [("/openai/v1/responses", ResponsesBody, ["input"]),
                                 ("/v1/messages", MessagesBody, ["messages", "max_tokens"]),
                                 ("/v1/messages/count_tokens", CountTokensBody, ["messages"])]:
        schema = body_schema(path)
        assert sorted(schema["required"]) == sorted(required), path
        assert set(schema["properties"]) == {f.alias or name for name, f in
                                             body.model_fields.items()}, path
        assert "model" in schema["properties"] and schema["additionalProperties"] is False
    responses, messages = body_schema("/openai/v1/responses"), body_schema("/v1/messages")
    assert messages["properties"]["max_tokens"]["minimum"] == 1
    assert messages["properties"]["messages"]["minItems"] == 1
    valid = [  # each: the handler's model takes it, and so does the published schema
        (ResponsesBody, {"input": "hello", "instructions": "be brief", "max_output_tokens": 3}),
        (ResponsesBody, {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
            "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}}),
        (MessagesBody, {"messages": ASK, "max_tokens": 10, "system": "sys"}),
        (MessagesBody, {
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            "max_tokens": 1, "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "auto"}}),
    ]
    refused = [(ResponsesBody, {"input": "x", "unknown": 1}), (MessagesBody, {"messages": ASK}),
               (MessagesBody, {"messages": [], "max_tokens": 1})]
    published = {ResponsesBody: responses, MessagesBody: messages}
    for model, body in valid:
        model.model_validate(body)
        jsonschema.validate(body, published[model])
    for model, body in refused:
        with pytest.raises(pydantic.ValidationError):
            model.model_validate(body)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, published[model])


def test_the_fuzz_bounds_every_field_that_sets_how_long_a_call_generates():
    """tests/helpers/fuzz.py draws valid bodies from this document: a max_tokens (Messages) or
    max_output_tokens (Responses) without an upper bound there would let one fuzzed call
    generate for minutes, so the fuzz caps them, as it caps n and best_of."""
    raw = run(_served())
    _cap_samples(raw)
    capped = {}
    for path, ops in raw["paths"].items():
        props = ops.get("post", {}).get("requestBody", {}).get("content", {}).get(
            "application/json", {}).get("schema", {}).get("properties", {})
        for name in set(FUZZ_CAPS) & set(props):
            ints = [b for b in [props[name], *props[name].get("anyOf", [])]
                    if b.get("type") == "integer"]
            highest = max((b.get("maximum", float("inf")) for b in ints), default=None)
            assert highest is not None and highest <= FUZZ_CAPS[name], (path, name, ints)
            capped[path, name] = ints
    assert {("/openai/v1/responses", "max_output_tokens"), ("/v1/messages", "max_tokens"),
            ("/openai/v1/completions", "max_tokens"), ("/openai/v1/completions", "n"),
            ("/openai/v1/chat/completions", "max_completion_tokens")} <= set(capped)
    assert capped["/v1/messages", "max_tokens"][0]["minimum"] == 1  # its own bound stays
