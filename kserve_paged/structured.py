"""The request forms of structured outputs -> one ``StructuredOutputs`` (or none).

Clients spell a constraint several ways, and a server that takes vLLM's place must read them
all: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs: {json, regex, choice, grammar, json_object}`` and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` names. v2 parameters
are scalars, so there a schema, a choice list or a whole ``structured_outputs`` object comes as
a JSON string. More than one constraint in a request is a 400, as is an invalid one: the
constraint is parsed here, before anything is queued.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kserve_paged import json_depth
from kserve_paged_engine.sampling_params import StructuredOutputs

# Names a constraint may come under; the server reads these, nothing else does.
GUIDED_NAMES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
STRUCTURED_OPTION_NAMES = ("structured_outputs", "response_format", *GUIDED_NAMES,
                           "guided_decoding_backend", "guided_whitespace_pattern")
# What a client may name as the backend: ours is xgrammar, and "auto" picks it.
_BACKENDS = ("auto", "xgrammar")


class StructuredOptionError(ValueError):
    """A malformed or invalid constraint; ``param`` names the field for OpenAI's error body."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _maybe_json(value: Any, param: str, allow_text: bool = False) -> Any:
    """v2 carries objects and lists as JSON strings: decode those, under the depth bound on
    JSON in a request field (json_depth.py). A string that is not JSON stays a string where
    ``allow_text`` (a schema given as text fails later, naming why)."""
    if not isinstance(value, str):
        return value
    try:
        return json_depth.loads(value, param)
    except json_depth.JSONTooDeep as exc:
        raise StructuredOptionError(str(exc), param) from None
    except ValueError:
        if allow_text:
            return value
        raise StructuredOptionError(f"{param} must be JSON (got {value[:80]!r})",
                                    param) from None


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str) and value.strip() in ("text", "json_object"):
        value = {"type": value.strip()}  # a v2 parameter may name the type alone
    fmt = _maybe_json(value, "response_format")
    if not isinstance(fmt, dict):
        raise StructuredOptionError("response_format must be an object", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise StructuredOptionError("response_format json_schema needs a json_schema "
                                        "object with a 'schema' object", "response_format")
        # OpenAI allows the schema to be left out: any JSON object then.
        schema = spec.get("schema")
        return {"json": schema} if schema else {"json_object": True}
    raise StructuredOptionError(f"response_format type {kind!r} is not supported (text, "
                                "json_object, json_schema)", "response_format")


def structured_outputs_option(options: Mapping[str, Any]) -> StructuredOutputs | None:
    """The request's one constraint, or None; raises StructuredOptionError naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    if options.get("response_format") not in (None, "", {}):
        spec = _from_response_format(options["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    so = options.get("structured_outputs")
    if so not in (None, "", {}):
        so = _maybe_json(so, "structured_outputs")
        if not isinstance(so, dict):
            raise StructuredOptionError("structured_outputs must be an object",
                                        "structured_outputs")
        found.append(("structured_outputs", dict(so)))
    for name, kind in GUIDED_NAMES.items():
        value = options.get(name)
        if value in (None, "", [], {}):
            continue
        if kind == "json":
            value = _maybe_json(value, name, allow_text=True)
        elif kind == "choice":
            value = _maybe_json(value, name)
        found.append((name, {kind: value}))
    backend = options.get("guided_decoding_backend")
    if backend and str(backend).lower() not in _BACKENDS:
        raise StructuredOptionError(f"guided_decoding_backend {backend!r} is not available "
                                    f"(this server uses {' or '.join(_BACKENDS)})",
                                    "guided_decoding_backend")
    if options.get("guided_whitespace_pattern"):
        raise StructuredOptionError("guided_whitespace_pattern is not supported (use "
                                    "structured_outputs.disable_any_whitespace)",
                                    "guided_whitespace_pattern")
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise StructuredOptionError(f"give one structured-output constraint, not several "
                                    f"({names})", found[1][0])
    param, spec = found[0]
    spec.pop("backend", None)
    try:
        return StructuredOutputs(**spec)
    except TypeError as exc:
        raise StructuredOptionError(f"{param}: {exc}", param) from None
    except ValueError as exc:
        raise StructuredOptionError(f"{param}: {exc}", param) from None
