"""Request options -> SamplingParams, shared by the v2 and OpenAI front ends.

Why one place: both protocols take the same knobs, and they must be validated the same way (a bad
value is a 400 naming the option, never something silently ignored or clamped).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kserve_paged.structured import StructuredOptionError, structured_outputs_option
from kserve_paged_engine.limits import LOGIT_BIAS_RANGE, MIN_MAX_TOKENS
from kserve_paged_engine.sampling_params import SamplingParams

# Options every front end accepts, with the types JSON / v2 parameters may carry them in.
SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                    "ignore_eos", "min_tokens", "stop_token_ids", "n", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
                    "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens",
                    "use_beam_search", "best_of", "length_penalty", "early_stopping",
                    "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
_INTS = ("max_tokens", "top_k", "seed", "min_tokens", "n", "logprobs", "prompt_logprobs",
         "best_of", "truncate_prompt_tokens")
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "length_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search")


class OptionError(ValueError):
    """A bad request option; ``param`` names it for OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _as_int(name: str, value: Any) -> int:
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


def _as_float(name: str, value: Any) -> float:
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


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise OptionError(f"{name} must be a boolean (got {value!r})", name)


def _as_early_stopping(value: Any) -> bool | str:
    """transformers' early_stopping: true, false or "never"."""
    if isinstance(value, str) and value.strip().lower() == "never":
        return "never"
    try:
        return _as_bool("early_stopping", value)
    except OptionError:
        raise OptionError(f'early_stopping must be true, false or "never" (got {value!r})',
                          "early_stopping") from None


def beam_width_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """v2's ``beam_width`` k as the engine's options: beam search over k beams returning
    ``n`` of them (default 1, transformers' num_return_sequences); 1 (or absent) is off."""
    out = dict(options)
    width = out.pop("beam_width", None)
    if width is None or (isinstance(width, str) and not width.strip()):
        return out
    k = _as_int("beam_width", width)
    if k != 1:
        out["use_beam_search"], out["best_of"] = True, k
    return out


def _as_stop(value: Any, name: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise OptionError(f"{name} must be a string or a list of strings (got {value!r})", name)


def _as_token_ids(value: Any, name: str = "stop_token_ids") -> list[int]:
    if value is None:
        return []
    if isinstance(value, str):
        # v2 parameters are scalars (KServe's JSON model, gRPC): accept "1,2" for a list.
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple)):
        return [_as_int(name, v) for v in value]
    raise OptionError(f"{name} must be a list of integers (got {value!r})", name)


def _as_logit_bias(value: Any, vocab_size: int | None) -> dict[int, float]:
    """``{"token id": bias}`` (JSON object, or a JSON string of one for v2's scalar parameters)
    -> ``{id: bias}``, checked as OpenAI does: ids in the vocabulary, biases in range. An
    id the model does not have is a 400 here, not an entry the engine would quietly skip."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise OptionError(f"logit_bias must be a JSON object of token id -> bias (got "
                              f"{value[:100]!r})", "logit_bias") from None
    if not isinstance(value, Mapping):
        raise OptionError(f"logit_bias must map token ids to numbers (got {value!r})",
                          "logit_bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        try:
            token = _as_int("logit_bias", key)
        except OptionError:
            raise OptionError(f"logit_bias keys must be token ids (got {key!r})",
                              "logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise OptionError(f"logit_bias: token id {key!r} is out of range for this model"
                              + (f" (vocabulary size {vocab_size})" if vocab_size else ""),
                              "logit_bias")
        amount = _as_float("logit_bias", number)
        low, high = LOGIT_BIAS_RANGE
        if not low <= amount <= high:
            raise OptionError(f"logit_bias: the bias for token {key!r} must be in "
                              f"[{low:g}, {high:g}] (got {number!r})", "logit_bias")
        bias[token] = amount
    return bias


# Options that clients send and that would change results, but that the engine cannot honour,
# with the values that are harmless (the default; an empty list, object or string also counts as
# not given). Any other value is refused with a 400 naming the option; options nobody knows are
# ignored with a warning (vLLM's behaviour). Both front ends check these: v2 parameters, and the
# OpenAI bodies' extra fields (vLLM's extras: beam search, guided decoding, ...).
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "beam_width": (1,), "num_beams": (1,),
    "return_tokens_as_token_ids": (False,), "logits_processors": (),
}
# Known to v2 only as refusals: OpenAI bodies declare and check these themselves.
V2_UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    **{k: v for k, v in UNSUPPORTED_OPTIONS.items() if k != "beam_width"}, "echo": (False,),
    "suffix": (), "tools": (), "top_logprobs": (0,),
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
            n = _as_int("n", options.get("n") if options.get("n") is not None else 1)
            ok = _as_int("best_of", best_of) == n
        except OptionError:
            ok = False
        if not ok:
            bad.append("best_of")
    return bad


def normalize_options(options: Mapping[str, Any], vocab_size: int | None = None
                      ) -> dict[str, Any]:
    """Coerce the known sampling options (None means "not given"); unknown keys are dropped."""
    out: dict[str, Any] = {}
    for name in SAMPLING_OPTIONS:
        value = options.get(name)
        if value is None:
            continue
        if name in _INTS:
            out[name] = _as_int(name, value)
        elif name in _FLOATS:
            out[name] = _as_float(name, value)
        elif name in _BOOLS:
            out[name] = _as_bool(name, value)
        elif name in ("stop", "bad_words"):
            out[name] = _as_stop(value, name)
        elif name == "logit_bias":
            out[name] = _as_logit_bias(value, vocab_size)
        elif name == "early_stopping":
            out[name] = _as_early_stopping(value)
        else:
            out[name] = _as_token_ids(value, name)
            if vocab_size is not None and any(t >= vocab_size for t in out[name]):
                raise OptionError(f"{name}: token ids must be below the vocabulary size "
                                  f"({vocab_size})", name)
    return out


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


def make_sampling_params(options: Mapping[str, Any], *, prompt_len: int, max_model_len: int,
                         default_max_tokens: int | None, vocab_size: int | None = None
                         ) -> SamplingParams:
    """SamplingParams for one prompt; raises OptionError with the offending option."""
    opts = normalize_options(options, vocab_size)
    cut = opts.get("truncate_prompt_tokens")
    if cut is not None and cut >= 1:  # the engine keeps the last `cut` tokens
        prompt_len = min(prompt_len, cut)
    requested = opts.pop("max_tokens", None)
    if requested is None and default_max_tokens is not None and prompt_len < max_model_len:
        # A default budget (not the client's) shrinks to what the context window leaves.
        requested = min(default_max_tokens, max_model_len - prompt_len)
    max_tokens = resolve_max_tokens(prompt_len, requested, max_model_len)
    try:
        structured = structured_outputs_option(options)
    except StructuredOptionError as exc:
        raise OptionError(str(exc), exc.param) from None
    try:
        return SamplingParams(max_tokens=max_tokens, structured_outputs=structured, **opts)
    except ValueError as exc:
        message = str(exc)
        # SamplingParams' messages name the option first ("...: top_p must be ..."); a plain
        # substring search would blame "logprobs" for "prompt_logprobs".
        named = re.search(r"parameter: (\w+)", message)
        param = named.group(1) if named and named.group(1) in SAMPLING_OPTIONS else None
        raise OptionError(message, param) from None


# generation_config.json's sampling fields that become defaults (vLLM's list), by our names.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str | None) -> dict[str, Any]:
    """`--generation_config auto`: the sampling defaults the model's folder ships in
    generation_config.json (none when it has none); a request's own values override them."""
    if not model_path:
        return {}
    from pathlib import Path

    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
            if config.get(theirs) is not None}


def with_defaults(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The request's options over the defaults (an option given as null counts as absent)."""
    merged = dict(options)
    for name, value in defaults.items():
        if merged.get(name) is None:
            merged[name] = value
    return merged
