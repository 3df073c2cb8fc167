"""Request options -> SamplingParams, shared by the v2 and OpenAI front ends.

Why one place: both protocols take the same knobs, and they must be validated the same way (a bad
value is a 400 naming the option, never something silently ignored or clamped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.sampling_params import SamplingParams

# Options every front end accepts, with the types JSON / v2 parameters may carry them in.
SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                    "ignore_eos", "min_tokens", "stop_token_ids")
_INTS = ("max_tokens", "top_k", "seed", "min_tokens")
_FLOATS = ("temperature", "top_p", "min_p")


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


def _as_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise OptionError(f"stop must be a string or a list of strings (got {value!r})", "stop")


def _as_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, str):
        # v2 parameters are scalars (KServe's JSON model, gRPC): accept "1,2" for a list.
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple)):
        return [_as_int("stop_token_ids", v) for v in value]
    raise OptionError(f"stop_token_ids must be a list of integers (got {value!r})",
                      "stop_token_ids")


# Options that clients send and that would change results, but that the engine cannot honour,
# with the values that are harmless (the default). Any other value is refused with a 400 naming
# the option; options nobody knows are ignored with a warning (vLLM's behaviour).
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "beam_width": (1,), "num_beams": (1,), "use_beam_search": (False,),
    "logprobs": (False, 0), "prompt_logprobs": (0,), "echo": (False,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "length_penalty": (1,), "logit_bias": (),
}


def unsupported_options(options: Mapping[str, Any]) -> list[str]:
    """Names of known options in ``options`` set to something the engine cannot do."""
    bad = []
    for name, harmless in UNSUPPORTED_OPTIONS.items():
        value = options.get(name)
        if value is None or (not isinstance(value, (list, dict)) and value in harmless):
            continue
        if isinstance(value, str) and value.strip().lower() in {str(h).lower() for h in harmless}:
            continue
        bad.append(name)
    return bad


def normalize_options(options: Mapping[str, Any]) -> dict[str, Any]:
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
        elif name == "ignore_eos":
            out[name] = _as_bool(name, value)
        elif name == "stop":
            out[name] = _as_stop(value)
        else:
            out[name] = _as_token_ids(value)
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
    if max_tokens < 1:
        raise OptionError(f"max_tokens must be at least 1 (got {max_tokens})", "max_tokens")
    if prompt_len + max_tokens > max_model_len:
        raise OptionError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.", "max_tokens")
    return max_tokens


def make_sampling_params(options: Mapping[str, Any], *, prompt_len: int, max_model_len: int,
                         default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams for one prompt; raises OptionError with the offending option."""
    opts = normalize_options(options)
    requested = opts.pop("max_tokens", None)
    if requested is None and default_max_tokens is not None and prompt_len < max_model_len:
        # A default budget (not the client's) shrinks to what the context window leaves.
        requested = min(default_max_tokens, max_model_len - prompt_len)
    max_tokens = resolve_max_tokens(prompt_len, requested, max_model_len)
    try:
        return SamplingParams(max_tokens=max_tokens, **opts)
    except ValueError as exc:
        message = str(exc)
        param = next((name for name in SAMPLING_OPTIONS if name in message), None)
        raise OptionError(message, param) from None
