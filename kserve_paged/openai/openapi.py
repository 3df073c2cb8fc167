"""What the OpenAI routes publish in /openapi.json.

The handlers parse bodies themselves (to answer in OpenAI's error shape, not FastAPI's 422), so
FastAPI cannot derive the schemas: they are built here from the pydantic bodies, with the value
ranges of kserve_paged_engine.limits (the numbers the engine validates against) laid over them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema

from kserve_paged.openai.errors import ERROR_SCHEMA
from kserve_paged_engine import limits as L


def _number(value: float) -> int | float:
    """A limit as JSON writes it best: 2 rather than 2.0."""
    return int(value) if float(value).is_integer() else value


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` inlined: an OpenAPI operation cannot carry
    ``$defs`` of its own (its ``$ref``s resolve against the whole document)."""
    defs = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...] = ()) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.rsplit("/", 1)[-1]
                if name in seen:  # recursive types: leave them open
                    return {}
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[name], (*seen, name)), **resolve(rest, seen)}
            return {k: resolve(v, seen) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v, seen) for v in node]
        return node

    return resolve(schema)



# One server-sent event (``data: {json chunk}`` or ``data: [DONE]``), as SSE parsers see it.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_PENALTY = {"minimum": _number(L.PENALTY_RANGE[0]), "maximum": _number(L.PENALTY_RANGE[1])}
_LOGPROBS = {"minimum": L.MIN_LOGPROBS, "maximum": L.MAX_LOGPROBS}
# What the handlers accept beyond the field types, published so that clients (and fuzzers) see
# the real contract: value ranges, and options that only take their default (no suffix;
# other values are 400s). Validation itself stays in the handlers,
# which answer in OpenAI's error shape.
_PUBLISHED: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": L.MIN_MAX_TOKENS},
    "max_completion_tokens": {"minimum": L.MIN_MAX_TOKENS},
    "temperature": {"minimum": _number(L.MIN_TEMPERATURE)},
    "top_p": {"exclusiveMinimum": _number(L.TOP_P_RANGE[0]),
              "maximum": _number(L.TOP_P_RANGE[1])},
    "top_k": {"minimum": L.MIN_TOP_K},
    "min_p": {"minimum": _number(L.MIN_P_RANGE[0]), "maximum": _number(L.MIN_P_RANGE[1])},
    "min_tokens": {"minimum": L.MIN_MIN_TOKENS},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}},
                       {"type": "null"}]},
    "stop_token_ids": {"anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}},
                                 {"type": "null"}]},
    "n": {"minimum": L.MIN_N, "maximum": L.MAX_N},
    "best_of": {"minimum": L.MIN_N, "maximum": L.MAX_N},
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": {"exclusiveMinimum": _number(L.REPETITION_PENALTY_RANGE[0]),
                           "maximum": _number(L.REPETITION_PENALTY_RANGE[1])},
    "logit_bias": {"anyOf": [{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {
                                  "type": "number", "minimum": _number(L.LOGIT_BIAS_RANGE[0]),
                                  "maximum": _number(L.LOGIT_BIAS_RANGE[1])}},
                             {"type": "null"}]},
    "prompt_logprobs": _LOGPROBS,
    "top_logprobs": _LOGPROBS,
    "response_format": {"anyOf": [{"type": "object", "properties": {"type": {
                                      "enum": ["text", "json_object", "json_schema"]}}},
                                  {"type": "null"}]},
    "suffix": {"anyOf": [{"const": ""}, {"type": "null"}]},
    "timeout": {"anyOf": [{"type": "number", "exclusiveMinimum": 0,
                           "maximum": _number(L.MAX_REQUEST_TIMEOUT_S)}, {"type": "null"}]},
    "functions": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
    "function_call": {"anyOf": [{"const": "none"}, {"type": "null"}]},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string"},
                       "content": {"anyOf": [{"type": "string"},
                                             {"type": "array", "items": _TEXT_PART},
                                             {"type": "null"}]}}}},
}
_PUBLISHED_BY_BODY: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionBody": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1,
                              "items": {"type": "string", "minLength": 1}},
                             _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
        "logprobs": {"anyOf": [{"type": "integer", **_LOGPROBS}, {"type": "null"}]},
    },
}


# A 413: the body is over --max_request_bytes, or its parse ran past its time limit
# (limits.body_decode_seconds).
_TOO_LARGE = ("The request body is too large (--max_request_bytes), or took too long to parse "
              "(a limit that grows with its size)")


def _request_schema(body: type[BaseModel], model_names: list[str]) -> dict[str, Any]:
    schema = _inline_refs(body.model_json_schema())
    props = schema["properties"]
    published = {**_PUBLISHED, **_PUBLISHED_BY_BODY.get(body.__name__, {})}
    if model_names:
        published["model"] = {"anyOf": [{"enum": model_names}, {"type": "null"}]}
    for name, extra in published.items():
        if name in props:
            field = props[name]
            if "anyOf" in extra or "type" in extra or "const" in extra:
                field = {k: v for k, v in field.items() if k in ("title", "default")}
            elif "anyOf" in field:  # constrain the non-null branch of an optional field
                field = {**field, "anyOf": [b if b.get("type") == "null" else {**b, **extra}
                                            for b in field["anyOf"]]}
                extra = {}
            props[name] = {**field, **extra}
    return schema


def operation_schema(body: type[BaseModel], result: type[BaseModel], model_names: list[str]
             ) -> dict[str, Any]:
    """What the route publishes in /openapi.json. The handlers parse the body themselves (to
    answer in OpenAI's error shape, not FastAPI's 422), so FastAPI cannot derive this."""
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _request_schema(body, model_names)}}},
        "responses": {
            "200": {"description": "The result, or with stream=true server-sent events",
                    "content": {"application/json": {
                                    "schema": _inline_refs(result.model_json_schema(
                                        mode="serialization"))},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            "400": {"description": "Invalid or unsupported request (or a prompt too long to "
                           "tokenize, --max_prompt_chars)", **error},
            "404": {"description": "Unknown model", **error},
            "408": {"description": "The request's deadline passed (timeout, x-request-timeout, "
                           "--request_timeout_s)", **error},
            "413": {"description": _TOO_LARGE, **error},
            "429": {"description": "The waiting queue is full (--max_waiting_requests); "
                           "see Retry-After", **error},
            "500": {"description": "Generation failed", **error},
            "503": {"description": "Not ready: loading, failed or shutting down", **error},
        },
    }


def pooling_operation_schema(body: type[BaseModel], model_names: list[str], what: str
                             ) -> dict[str, Any]:
    """A pooling route (embeddings, rerank, score, classify, openai/pooling.py): its body's
    schema, a JSON object out (no streaming)."""
    op = _object_operation(_request_schema(body, model_names), what)
    del op["responses"]["200"]["content"]["text/event-stream"]
    return op


class _OverlappingUnions(GenerateJsonSchema):
    """The SDK bodies' unions (openai.schemas.by_type) each have a catch-all member (Other*,
    refused by the converter by name) that matches what the others match too, so JSON
    Schema's ``oneOf``, which pydantic writes for them, would refuse every valid member: they
    are published as the ``anyOf`` they are."""

    def tagged_union_schema(self, schema: Any) -> dict[str, Any]:
        out = super().tagged_union_schema(schema)
        if "oneOf" in out:
            out["anyOf"] = out.pop("oneOf")
        return out


def sdk_operation_schema(body: type[BaseModel], what: str) -> dict[str, Any]:
    """The Responses and Messages routes in /openapi.json: the schema of the pydantic body their
    handler validates (typed after the OpenAI and Anthropic SDKs: responses_body.py,
    anthropic/body.py) in; the codes they answer out, `what` a JSON object or with stream=true
    server-sent events, and errors in the protocol's shape."""
    return _object_operation(_inline_refs(body.model_json_schema(
        schema_generator=_OverlappingUnions)), what)


def _object_operation(request: dict[str, Any], what: str) -> dict[str, Any]:
    """`request` the body's JSON schema in; `what` (a JSON object or server-sent events) and
    the codes these routes answer out, their errors any JSON object."""
    error = {"content": {"application/json": {"schema": {"type": "object"}}}}
    codes = {"400": "Invalid or unsupported request", "404": "Unknown model",
             "408": "The request's deadline passed", "413": _TOO_LARGE,
             "429": "The waiting queue is full; see Retry-After", "500": "Generation failed",
             "503": "Not ready: loading, failed or shutting down"}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": what, "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": _SSE_EVENT}}},
            **{code: {"description": text, **error} for code, text in codes.items()},
        },
    }
