"""schemathesis over every operation the server publishes in /openapi.json (issue 37 part 5):
the OpenAI routes, structured outputs, tools and beam search in their bodies, the LoRA routes,
KServe's v1/v2 routes, and whatever routes are added later (none is listed here, so none is
left out by omission)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import httpx

# Operations not fuzzed, each with its reason. Everything else in /openapi.json is.
EXCLUDED = {
    # KServe's model-repository extension: loading or unloading the served model by name is
    # what these routes are for, and an unloaded model would fail every later call.
    ("POST", "/v2/repository/models/{model_name}/load"): "changes which models are served",
    ("POST", "/v2/repository/models/{model_name}/unload"): "changes which models are served",
}
# Routes that generate tokens get the examples the OpenAI routes always had; others fewer
# (they answer at once, and there are many).
GENERATING = re.compile(r"/(completions|responses|messages|infer|:predict|:explain)$")
FUZZ_MAX_N = 4
FUZZ_MAX_TOKENS = 16
# The bounds the fuzz puts on the fields that set how long one call generates for.
FUZZ_CAPS = {"n": FUZZ_MAX_N, "best_of": FUZZ_MAX_N, "max_tokens": FUZZ_MAX_TOKENS,
             "max_completion_tokens": FUZZ_MAX_TOKENS, "max_output_tokens": FUZZ_MAX_TOKENS}


def _cap_samples(raw: dict[str, Any]) -> None:
    """n up to 128 is valid, but 128 samples of up to 64 tokens take about a minute on two CPU
    cores, and max_tokens (Messages) or max_output_tokens (Responses) have no upper bound: fuzz
    with at most FUZZ_MAX_N samples (and beams) of FUZZ_MAX_TOKENS tokens so every call fits
    the budget."""
    for ops in raw["paths"].values():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            props = body.get("schema", {}).get("properties", {})
            for name, cap in FUZZ_CAPS.items():
                field = props.get(name, {})
                for branch in [field, *field.get("anyOf", [])]:
                    if branch.get("type") == "integer":
                        branch["maximum"] = min(cap, branch.get("maximum", cap))


def _known_model_names(raw: dict[str, Any], names: list[str]) -> None:
    """Path parameter model_name: the served names (valid data reaches the model; invalid
    data still tries others)."""
    for ops in raw["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []) if isinstance(op, dict) else []:
                if param.get("in") == "path" and param.get("name") == "model_name":
                    param["schema"] = {"type": "string", "enum": names}


def fuzz_every_route(url: str, model: str) -> dict[str, Any]:
    """Run schemathesis on every published operation but EXCLUDED; returns the calls by status
    and by operation. Raises (schemathesis' report) on the first violated check."""
    import requests
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    raw = httpx.get(f"{url}/openapi.json", timeout=10).json()
    _cap_samples(raw)
    _known_model_names(raw, [model])
    schema = schemathesis.openapi.from_dict(raw)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    calls: Counter[int] = Counter()
    per_op: Counter[str] = Counter()
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) not in EXCLUDED]
    session = requests.Session()
    for operation in operations:
        has_input = bool(operation.body) or bool(operation.path_parameters)
        modes = ([GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_input
                 else [GenerationMode.POSITIVE])
        generating = bool(GENERATING.search(operation.path))
        label = f"{operation.method.upper()} {operation.path}"
        for mode in modes:
            # Positive cases generate tokens (~0.5 s each on 2 CPU cores); negative ones are
            # refused at once, so they get more examples.
            examples = ((25 if mode is GenerationMode.POSITIVE else 50) if generating
                        else (5 if mode is GenerationMode.POSITIVE else 15))

            _run(operation.as_strategy(generation_mode=mode), examples, label, calls, per_op,
                 lambda case: case.call_and_validate(base_url=url, session=session,
                                                     checks=checks, timeout=180))
    return {"codes": {str(c): n for c, n in sorted(calls.items())}, "operations": dict(per_op),
            "excluded": [f"{m} {p}" for m, p in EXCLUDED]}


def _run(strategy: Any, examples: int, label: str, calls: Counter[int], per_op: Counter[str],
         call: Any) -> None:
    """``examples`` generated cases of one operation, each called and checked."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case: Any) -> None:
        calls[call(case).status_code] += 1
        per_op[label] += 1

    fuzz()
