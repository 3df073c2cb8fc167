"""A constraint on the output (vLLM's ``structured_outputs``), checked and parsed when made:
a bad schema, regex, choice or grammar fails before its request is queued. Compiled against
the tokenizer and enforced by engine/kserve_paged_engine/sample/structured_output.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kserve_paged_engine import limits as L

# Blanks allowed between JSON elements: enough for pretty-printed output, too few for a model
# to fill its whole budget with whitespace.
MAX_JSON_WHITESPACE = 32
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _clean(exc: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text).strip() or type(exc).__name__


@dataclass(slots=True)
class StructuredOutputs:
    """One constraint on the output, as vLLM's ``structured_outputs`` spells it: ``json`` (a
    JSON schema, object or string), ``json_object`` (any JSON object), ``regex``, ``choice``
    (one of the strings) or ``grammar`` (EBNF, or Lark)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # The constraint starts once the output has this token (a reasoning model's `</think>`)
    # or these tokens in a row (Harmony's `<|channel|>final<|message|>`): what comes before
    # is free, and the grammar holds from the token after them on.
    start_after_token_id: int | tuple[int, ...] | None = None
    kind: str = field(init=False, default="")
    key: str = field(init=False, default="")  # what compiled grammars are cached by
    _grammar: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice or grammar (got {', '.join(given) or 'none'})")
        self.kind = given[0]
        self._grammar = self._parse()
        text = {"json": self.json, "regex": self.regex, "grammar": self.grammar,
                "choice": json.dumps(self.choice), "json_object": ""}[self.kind]
        self.key = f"{self.kind}:{int(self.disable_any_whitespace)}:{text}"

    def _parse(self) -> Any:
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                if isinstance(self.json, str):
                    try:
                        schema = json.loads(self.json)
                    except RecursionError:  # past the interpreter's limit: far past ours
                        raise ValueError(f"the JSON schema is nested more than "
                                         f"{L.MAX_SCHEMA_DEPTH} levels deep") from None
                    except ValueError as exc:
                        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
                else:
                    schema = self.json
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                L.check_schema_shape(schema)  # before json.dumps: it recurses
                self.json = json.dumps(schema)  # key order kept: it is the output order
                L.check_text_size(self.json, L.MAX_SCHEMA_BYTES, "the JSON schema")
                return xgr.Grammar.from_json_schema(
                    self.json, any_whitespace=not self.disable_any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE, strict_mode=True)
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "regex":
                if not isinstance(self.regex, str) or not self.regex:
                    raise ValueError("regex must be a non-empty string")
                L.check_text_size(self.regex, L.MAX_REGEX_CHARS, "the regex")
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                if (not isinstance(self.choice, list) or not self.choice
                        or not all(isinstance(c, str) and c for c in self.choice)):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                if len(self.choice) > L.MAX_ENUM_VALUES:
                    raise ValueError(f"choice has {len(self.choice)} strings, more than "
                                     f"{L.MAX_ENUM_VALUES}")
                L.check_text_size("".join(self.choice), L.MAX_SCHEMA_BYTES, "choice")
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c) for c in self.choice))
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("grammar must be a non-empty string")
            L.check_text_size(self.grammar, L.MAX_GRAMMAR_CHARS, "the grammar")
            try:
                return xgr.Grammar.from_ebnf(self.grammar)
            except RuntimeError as ebnf_error:
                try:
                    return xgr.Grammar.from_lark(self.grammar)
                except Exception:  # noqa: BLE001 - report the EBNF parser's message
                    raise ebnf_error from None
        except ValueError as exc:
            raise ValueError(f"invalid structured output ({kind}): {exc}") from None
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others
            raise ValueError(f"invalid structured output ({kind}): {_clean(exc)}") from None

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: True if self.kind == "json_object" else getattr(self, self.kind)}
