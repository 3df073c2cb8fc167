"""Caps on what one request may ask of the server and engine, each a flag (issue 49): the
lists of its options, its prompts, a prompt given as token ids. A request over one is a 400
naming the flag, before anything reads the list.

Why: a client's list costs the server and the engine thread work in proportion to its length
(coercion, checks, tokenizing bad words, building the engine's prepared filters), and the
request body limit alone allowed lists of millions of entries. vLLM has no such caps; each
default (kserve_paged_engine/limits.py) is far above what a real request sends, and the
engine's per-step work does not grow with the lists either way.

The flags are the server's, one set per process (KServe's ModelServer serves one): the server
sets them at start-up (`set_request_caps`), every route checks against them
(`request_options.SamplingRequest.of`, `PagedLLMModel.encode`, and `check_prompt_count` where a
route splits a request into prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from kserve_paged.flag_types import positive_int
from kserve_paged.option_error import OptionError
from kserve_paged_engine import limits as L


def _cap(default: int | None, flag_help: str) -> Any:
    """A cap: a RequestCaps field and its flag (--<field name>, a positive int), one entry."""
    return dataclasses.field(default=default, metadata={"help": flag_help, "type": positive_int})


@dataclasses.dataclass(frozen=True, slots=True)
class RequestCaps:
    """The caps in force; each field is the flag of the same name, defined by its entry here
    (default and help), so a new cap is one field."""

    max_allowed_token_ids: int | None = _cap(  # None: the model's vocabulary size
        None,
        "Most entries of a request's allowed_token_ids; a longer list is a 400 before it is "
        "read. Default: the model's vocabulary size (a longer list repeats ids).")
    max_bad_words: int = _cap(
        L.DEFAULT_MAX_BAD_WORDS,
        "Most bad_words of one request (each is tokenized when the request is admitted); "
        f"also at most {L.MAX_BAD_WORDS_CHARS} characters in all.")
    max_stop: int = _cap(
        L.DEFAULT_MAX_STOP,
        "Most stop strings of one request, and most stop_token_ids (each is checked after "
        "every token).")
    max_prompts: int = _cap(
        L.DEFAULT_MAX_PROMPTS,
        "Most prompts in one request (a completions prompt list, v2 inputs); more is a 400 "
        "before any is tokenized.")
    max_prompt_token_ids: int | None = _cap(  # None: the model's context window
        None,
        "Longest prompt sent as token ids; a longer one is a 400 before its ids are read. "
        "Default: max_model_len (a longer prompt cannot fit; raise it for clients that send "
        "longer ones with truncate_prompt_tokens).")


# Each capped list option -> the cap (a RequestCaps field, the flag's name) that bounds it.
LIST_OPTION_CAPS = {"allowed_token_ids": "max_allowed_token_ids", "bad_words": "max_bad_words",
                    "stop": "max_stop", "stop_token_ids": "max_stop"}
_TOKEN_ID_OPTIONS = ("allowed_token_ids", "stop_token_ids")  # v2 may send them as "1,2,3"

_active = RequestCaps()


def set_request_caps(caps: RequestCaps) -> None:
    """The caps every request is checked against from now on (the server's flags)."""
    global _active
    _active = caps


def request_caps() -> RequestCaps:
    return _active


def caps_from_args(args: argparse.Namespace) -> RequestCaps:
    return RequestCaps(**{f.name: getattr(args, f.name)
                          for f in dataclasses.fields(RequestCaps)})


def _refusal(what: str, count: int, cap: str, limit: int, param: str | None) -> OptionError:
    return OptionError(f"{what} has {count} entries, more than this server takes (--{cap} "
                       f"{limit}); send fewer, or raise the server's --{cap}", param)


def _entries(name: str, value: Any) -> int:
    """How many entries a wire value holds, without reading them: a list's length; a string
    is one stop string or bad word, or v2's comma-separated token ids."""
    if isinstance(value, str):
        return value.count(",") + 1 if name in _TOKEN_ID_OPTIONS else 1
    if isinstance(value, (list, tuple)):
        return len(value)
    return 1


def check_option_sizes(wire: Mapping[str, Any], caps: RequestCaps | None = None,
                       vocab_size: int | None = None) -> None:
    """Refuse (OptionError naming the option and the flag) a list option over its cap."""
    caps = caps or _active
    for name, cap in LIST_OPTION_CAPS.items():
        value = wire.get(name)
        if value is None:
            continue
        count, limit = _entries(name, value), getattr(caps, cap)
        if limit is None:  # allowed_token_ids: longer than the vocabulary, it repeats ids
            limit = vocab_size or L.DEFAULT_MAX_ALLOWED_TOKEN_IDS
        if count > limit:
            raise _refusal(name, count, cap, limit, name)


def check_prompt_count(count: int, caps: RequestCaps | None = None) -> None:
    """Refuse a request of more prompts than --max_prompts, before any is tokenized."""
    limit = (caps or _active).max_prompts
    if count > limit:
        raise _refusal("the request's prompt list", count, "max_prompts", limit, "prompt")


def prompt_token_ids_limit(max_model_len: int, caps: RequestCaps | None = None) -> int:
    limit = (caps or _active).max_prompt_token_ids
    return max_model_len if limit is None else limit


def check_prompt_token_ids(count: int, max_model_len: int,
                           caps: RequestCaps | None = None) -> None:
    """Refuse a prompt of more token ids than --max_prompt_token_ids (default: the context
    window, which a longer prompt cannot fit) before its ids are read."""
    limit = prompt_token_ids_limit(max_model_len, caps)
    if count > limit:
        raise _refusal("the prompt's token id list", count, "max_prompt_token_ids", limit,
                       "prompt")


def add_request_cap_flags(group: argparse._ArgumentGroup) -> None:
    """The caps' flags, in the server's group of request limits: one per RequestCaps field."""
    for cap in dataclasses.fields(RequestCaps):
        group.add_argument(f"--{cap.name}", type=cap.metadata["type"], default=cap.default,
                           help=cap.metadata["help"])
