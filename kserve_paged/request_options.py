"""Request options -> SamplingParams: the one table of them, shared by every front end.

Each sampling option a client may send is named once, in ``OPTIONS``: the wire name is the
SamplingParams field it sets, with how any wire value becomes that field's value (v2
parameters are scalars and strings: "0.5", "true", "1,2", a JSON object as text) and its type
in an OpenAI body (openai/schemas.py declares its fields from here), so every protocol
validates alike: a bad value is a 400 naming the option, never ignored or clamped. A front end
turns what it received into a :class:`SamplingRequest` once, before any prompt is tokenized;
the served model makes each prompt's SamplingParams from it, under the client's values its
own defaults (generation_config.json).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kserve_paged import json_depth
from kserve_paged.option_error import OptionError
from kserve_paged.request_caps import check_option_sizes
from kserve_paged.structured import (
    STRUCTURED_OPTION_NAMES,
    StructuredOptionError,
    structured_outputs_option,
)
from kserve_paged_engine.limits import LOGIT_BIAS_RANGE, MIN_MAX_TOKENS
from kserve_paged_engine.output_constraints import StructuredOutputs
from kserve_paged_engine.sampling_params import SamplingParams


def as_int(name: str, value: Any, vocab_size: int | None = None) -> int:
    if isinstance(value, bool):
        raise OptionError(f"{name} must be an integer (got {value!r})", name)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if isinstance(value, int):
        return value
    raise OptionError(f"{name} must be an integer (got {value!r})", name)


def _as_float(name: str, value: Any, vocab_size: int | None = None) -> float:
    # Strings are accepted because KServe's gRPC parameters cannot carry a double.
    if isinstance(value, bool):
        raise OptionError(f"{name} must be a number (got {value!r})", name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be a number (got {value!r})", name) from None
    if not math.isfinite(number):
        raise OptionError(f"{name} must be a finite number (got {value!r})", name)
    return number


def _as_bool(name: str, value: Any, vocab_size: int | None = None) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise OptionError(f"{name} must be a boolean (got {value!r})", name)


def _as_early_stopping(name: str, value: Any, vocab_size: int | None = None) -> bool | str:
    """transformers' early_stopping: true, false or "never"."""
    if isinstance(value, str) and value.strip().lower() == "never":
        return "never"
    try:
        return _as_bool(name, value)
    except OptionError:
        raise OptionError(f'{name} must be true, false or "never" (got {value!r})',
                          name) from None


def _as_stop(name: str, value: Any, vocab_size: int | None = None) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise OptionError(f"{name} must be a string or a list of strings (got {value!r})", name)


def _as_token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    if isinstance(value, str):
        # v2 parameters are scalars (KServe's JSON model, gRPC): accept "1,2" for a list.
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise OptionError(f"{name} must be a list of integers (got {value!r})", name)
    # A JSON list of ints (the usual case) is taken in C-speed passes, not one call per id.
    ids = (list(value) if set(map(type, value)) <= {int}
           else [as_int(name, v) for v in value])
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise OptionError(f"{name}: token ids must be below the vocabulary size "
                          f"({vocab_size})", name)
    return ids


def _as_logit_bias(name: str, value: Any, vocab_size: int | None = None) -> dict[int, float]:
    """``{"token id": bias}`` (JSON object, or a JSON string of one for v2's scalar parameters)
    -> ``{id: bias}``, checked as OpenAI does: ids in the vocabulary, biases in range. An
    id the model does not have is a 400 here, not an entry the engine would quietly skip."""
    if isinstance(value, str):
        try:
            value = json_depth.loads(value, name) if value.strip() else {}
        except json_depth.JSONTooDeep as exc:
            raise OptionError(str(exc), name) from None
        except ValueError:
            raise OptionError(f"logit_bias must be a JSON object of token id -> bias (got "
                              f"{value[:100]!r})", name) from None
    if not isinstance(value, Mapping):
        raise OptionError(f"logit_bias must map token ids to numbers (got {value!r})", name)
    bias: dict[int, float] = {}
    for key, number in value.items():
        try:
            token = as_int(name, key)
        except OptionError:
            raise OptionError(f"logit_bias keys must be token ids (got {key!r})", name) from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise OptionError(f"logit_bias: token id {key!r} is out of range for this model"
                              + (f" (vocabulary size {vocab_size})" if vocab_size else ""), name)
        amount = _as_float(name, number)
        low, high = LOGIT_BIAS_RANGE
        if not low <= amount <= high:
            raise OptionError(f"logit_bias: the bias for token {key!r} must be in "
                              f"[{low:g}, {high:g}] (got {number!r})", name)
        bias[token] = amount
    return bias


@dataclass(frozen=True, slots=True)
class Option:
    """One sampling option. ``coerce(name, value, vocab_size)`` turns any wire value into the
    field's; ``body_type`` (with ``body_default``) is its field in an OpenAI body, None where
    each body declares its own (``logprobs``: a number on completions, a flag on chat)."""

    coerce: Callable[[str, Any, int | None], Any]
    body_type: Any = None
    body_default: Any = None


# The sampling options: each wire name is the SamplingParams field it sets. Structured outputs,
# spelled several ways, are structured.py's (STRUCTURED_OPTION_NAMES); Responses and Messages
# spell a few of these their own way and convert to the chat body's names.
OPTIONS: dict[str, Option] = {
    "max_tokens": Option(as_int, int | None),
    "temperature": Option(_as_float, float | None),
    "top_p": Option(_as_float, float | None),
    "top_k": Option(as_int, int | None),
    "min_p": Option(_as_float, float | None),
    "seed": Option(as_int, int | None),
    "stop": Option(_as_stop, str | list[str] | None),
    "ignore_eos": Option(_as_bool, bool, False),
    "min_tokens": Option(as_int, int | None),
    "stop_token_ids": Option(_as_token_ids, list[int] | None),
    "n": Option(as_int, int, 1),
    "presence_penalty": Option(_as_float, float | None),
    "frequency_penalty": Option(_as_float, float | None),
    "repetition_penalty": Option(_as_float, float | None),
    "logit_bias": Option(_as_logit_bias, dict[str, float] | None),
    "logprobs": Option(as_int),
    "prompt_logprobs": Option(as_int, int | None),
    "include_stop_str_in_output": Option(_as_bool, bool | None),
    "skip_special_tokens": Option(_as_bool, bool | None),
    # vLLM's beam search: best_of beams (default n), the n best returned.
    "use_beam_search": Option(_as_bool, bool, False),
    "best_of": Option(as_int, int | None),
    "length_penalty": Option(_as_float, float | None),
    "early_stopping": Option(_as_early_stopping, bool | str | None),
    # vLLM's token filters and prompt cut (engine/kserve_paged_engine/sampling_params.py)
    "allowed_token_ids": Option(_as_token_ids, list[int] | None),
    "bad_words": Option(_as_stop, list[str] | None),
    "truncate_prompt_tokens": Option(as_int, int | None),
}
SAMPLING_OPTIONS = tuple(OPTIONS)


def structured_given(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` spell a structured output at all (checked here so that a request
    without one never enters structured.py)."""
    return any(values.get(name) not in (None, "", [], {}) for name in STRUCTURED_OPTION_NAMES)


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """A request's sampling options, coerced and checked before its prompts are known: what a
    front end hands the served model. ``values``: the SamplingParams fields the client set
    (one it left out, a model default may fill); ``structured``: its one constraint;
    ``default_max_tokens``: the budget when none is given (the endpoint's, the model's)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    structured: StructuredOutputs | None = None
    default_max_tokens: int | None = None
    # The prompts' SamplingParams are copies of one made per model defaults (params()): they
    # share its lists and what the engine prepares from them, so a request's lists are checked
    # and prepared once however many prompts it has (SamplingParams.shared).
    _made: dict[int, tuple[SamplingRequest | None, SamplingParams]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, wire: Mapping[str, Any], *, vocab_size: int | None = None,
           default_max_tokens: int | None = None) -> SamplingRequest:
        """The options in ``wire`` (an OpenAI body's fields, v2 parameters); a name not in the
        table is not ours to read; None means "not given". Lists over the server's caps
        are refused before they are read (request_caps.py)."""
        check_option_sizes(wire, vocab_size=vocab_size)
        values = {name: option.coerce(name, wire[name], vocab_size)
                  for name, option in OPTIONS.items() if wire.get(name) is not None}
        structured = None
        if structured_given(wire):
            try:
                structured = structured_outputs_option(wire)
            except StructuredOptionError as exc:
                raise OptionError(str(exc), exc.param) from None
        # Each value's range, before the prompt is rendered or tokenized (the budget waits for
        # the prompt's length: params()).
        _sampling_params({k: v for k, v in values.items() if k != "max_tokens"}, structured, None)
        return cls(values, structured, default_max_tokens)

    def with_values(self, **values: Any) -> SamplingRequest:
        """This request with ``values`` (already coerced) set over its own."""
        return replace(self, values={**self.values, **values})

    def params(self, prompt_len: int, max_model_len: int,
               defaults: SamplingRequest | None = None) -> SamplingParams:
        """One prompt's SamplingParams, ``defaults`` (the model's) under the client's values;
        OptionError naming the option the engine refuses."""
        values = dict(self.values)
        default_max = self.default_max_tokens
        if defaults is not None:
            values = {**defaults.values, **values}
            if defaults.default_max_tokens is not None:  # a default budget, never the client's
                default_max = (defaults.default_max_tokens if default_max is None
                               else min(defaults.default_max_tokens, default_max))
        cut = values.get("truncate_prompt_tokens")
        if cut is not None and cut >= 1:  # the engine keeps the last `cut` tokens
            prompt_len = min(prompt_len, cut)
        requested = values.pop("max_tokens", None)
        if requested is None and default_max is not None and prompt_len < max_model_len:
            # A default budget (not the client's) shrinks to what the context window leaves.
            requested = min(default_max, max_model_len - prompt_len)
        max_tokens = resolve_max_tokens(prompt_len, requested, max_model_len)
        made = self._made.get(id(defaults))
        if made is None or made[0] is not defaults:
            made = self._made[id(defaults)] = (
                defaults, _sampling_params(values, self.structured, None))
        try:
            return made[1].with_max_tokens(max_tokens)
        except ValueError as exc:
            raise _option_error(exc) from None


def _sampling_params(values: dict[str, Any], structured: Any,
                     max_tokens: int | None) -> SamplingParams:
    """SamplingParams of coerced values; OptionError naming the option the engine refuses."""
    try:
        return SamplingParams(max_tokens=max_tokens, structured_outputs=structured, **values)
    except ValueError as exc:
        raise _option_error(exc) from None


def _option_error(exc: ValueError) -> OptionError:
    message = str(exc)
    # SamplingParams' messages name the option first ("...: top_p must be ..."); a plain
    # substring search would blame "logprobs" for "prompt_logprobs".
    named = re.search(r"parameter: (\w+)", message)
    param = named.group(1) if named and named.group(1) in OPTIONS else None
    return OptionError(message, param)


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget, checked against the context window like vLLM does: a request that
    cannot fit is refused up front instead of being cut short by the engine."""
    if prompt_len >= max_model_len:
        raise OptionError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens, which leaves no room for output. Shorten the prompt.",
            "prompt" if max_tokens is None else "max_tokens")
    if max_tokens is None:
        return max_model_len - prompt_len
    if max_tokens < MIN_MAX_TOKENS:
        raise OptionError(f"max_tokens must be at least {MIN_MAX_TOKENS} (got {max_tokens})",
                          "max_tokens")
    if prompt_len + max_tokens > max_model_len:
        raise OptionError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.", "max_tokens")
    return max_tokens


# Options that clients send and that would change results, but that the engine cannot honour,
# with the values that are harmless (the default; an empty list, object or string also counts as
# not given). Any other value is refused with a 400 naming the option; options nobody knows are
# ignored with a warning (vLLM's behaviour). Both front ends check these: v2 parameters, and the
# OpenAI bodies' extra fields (vLLM's extras: beam search, guided decoding, ...).
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "beam_width": (1,), "num_beams": (1,),
    "return_tokens_as_token_ids": (False,), "logits_processors": (),
}


def _harmless(value: Any, harmless: tuple[Any, ...]) -> bool:
    if value is None or (isinstance(value, (list, dict, str)) and not value):
        return True
    if isinstance(value, (list, dict)):
        return False
    if isinstance(value, str):
        return value.strip().lower() in {str(h).lower() for h in harmless}
    return value in harmless


def _truthy(value: Any) -> bool:
    try:
        return value is not None and _as_bool("use_beam_search", value)
    except OptionError:
        return False


def unsupported_options(options: Mapping[str, Any],
                        table: Mapping[str, tuple[Any, ...]] = UNSUPPORTED_OPTIONS,
                        check_best_of: bool = True) -> list[str]:
    """Names of known options in ``options`` set to something the engine cannot do; also
    ``best_of`` unless it equals ``n`` or beam search is on (we return every sample, so
    best_of > n without beam search would mean choosing among samples by likelihood, which we
    do not; with beam search it is the beam width)."""
    bad = [name for name, harmless in table.items() if not _harmless(options.get(name), harmless)]
    beam = options.get("use_beam_search")
    best_of = options.get("best_of") if check_best_of and not _truthy(beam) else None
    if best_of is not None:
        try:
            n = as_int("n", options.get("n") if options.get("n") is not None else 1)
            ok = as_int("best_of", best_of) == n
        except OptionError:
            ok = False
        if not ok:
            bad.append("best_of")
    return bad
