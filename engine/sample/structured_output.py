"""Constrained decoding: a request's output held to a JSON schema, regex, choice or grammar.

xgrammar does the work (vLLM's default backend; CPU and GPU). Three stages, each where it costs
least (design: docs/engine.md, "Structured outputs"):
- ``StructuredOutputs`` parses the constraint into a tokenizer-free grammar when the request is
  made, so a bad schema, regex or grammar is a ValueError before anything is queued;
- ``GrammarCompiler`` compiles it against the tokenizer on a worker thread, cached by the
  constraint's text; the request waits in the queue (the scheduler skips it) until that is done;
- ``RequestGrammar`` holds the request's matcher: each step fills the allowed-token bitmask of
  its row and, after sampling, accepts the sampled token.
Preemption needs nothing: outputs survive recompute, so the matcher is still where it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and xgrammar load on first use: SamplingParams imports this module
    import torch

# Compiled grammars kept for reuse (an agent sends the same few schemas again and again).
COMPILED_CACHE_ENTRIES = 256
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
                    except ValueError as exc:
                        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
                else:
                    schema = self.json
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be a JSON object")
                self.json = json.dumps(schema)  # key order kept: it is the output order
                return xgr.Grammar.from_json_schema(
                    self.json, any_whitespace=not self.disable_any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE, strict_mode=True)
            if kind == "json_object":
                return xgr.Grammar.builtin_json_grammar()
            if kind == "regex":
                if not isinstance(self.regex, str) or not self.regex:
                    raise ValueError("regex must be a non-empty string")
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                if (not isinstance(self.choice, list) or not self.choice
                        or not all(isinstance(c, str) and c for c in self.choice)):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c) for c in self.choice))
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("grammar must be a non-empty string")
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


class GrammarCompiler:
    """Compiles constraints against one tokenizer on a worker thread, cached by their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = (
            collections.OrderedDict())
        self.compile_seconds: list[float] = []  # per compiled constraint (benchmarks read it)

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > COMPILED_CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputs) -> Any:
        import time

        import xgrammar as xgr

        if self._compiler is None:  # the tokenizer's table: built once, on first use
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(spec._grammar)
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's constraint: its compile future, then its matcher."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future
        self.matcher: Any = None

    @property
    def compiling(self) -> bool:
        """True until the engine has made the matcher (the scheduler waits for that, not
        just for the compile, so a step never meets a constrained row without one)."""
        return self.matcher is None

    def start(self) -> None:
        """Make the matcher once the grammar is compiled; re-raises a failed compile."""
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result())


class GrammarBitmask:
    """The step's allowed-token masks, filled row by row and applied to all rows at once."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffer: torch.Tensor | None = None  # int32 [rows, ceil(vocab / 32)]

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
        """``logits`` with every disallowed token of a constrained row at -inf (a copy when
        any row is constrained, so the raw logits stay for logprobs)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        import xgrammar as xgr

        if self._buffer is None or self._buffer.shape[0] < len(grammars):
            self._buffer = xgr.allocate_token_bitmask(max(len(grammars), 8), self.vocab_size)
        for i in rows:
            grammars[i].matcher.fill_next_token_bitmask(self._buffer, i)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, self._buffer[:len(grammars)].to(logits.device),
                                        vocab_size=self.vocab_size, indices=rows)
        return masked
