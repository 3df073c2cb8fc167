"""What a server flag's text means: the value parsers of kserve_paged/args.py (kept apart from
the parser itself, which imports KServe's, so the capacity planner's command can share them)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from kserve_paged.vllm_flags import negated
from kserve_paged_engine.config.kv_events import KVEventsConfig
from kserve_paged_engine.config.kv_tier import KVTierConfig
from kserve_paged_engine.spec_decode import SpeculativeConfig

_TRUE = frozenset({"1", "true", "yes", "y", "on", "t"})
_FALSE = frozenset({"0", "false", "no", "n", "off", "f"})
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*$")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number of seconds (or other amount) > 0."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def parse_memory(text: str) -> float | int:
    """``--kv_cache_memory``: a fraction of free device memory (``0 < x <= 1``) or bytes (``> 1``,
    optionally with a unit: ``8e9``, ``16GiB``, ``512Mi``). Fractions stay floats, bytes are ints."""
    match = _MEMORY_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in (0, 1] or a byte count such as 8e9 or 16GiB, got {text!r}")
    number = float(match.group(1))
    unit = (match.group(2) or "").lower()
    if unit:
        return int(number * _UNITS[unit])
    if number <= 0:
        raise argparse.ArgumentTypeError(f"--kv_cache_memory must be > 0, got {text!r}")
    return number if number <= 1 else int(number)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv_events_config``: vLLM's JSON, e.g. ``{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@pod@model"}``."""
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_kv_transfer_config(text: str) -> KVTierConfig:
    """``--kv_transfer_config``: vLLM's OffloadingConnector JSON as KServe renders
    spec.kvCacheOffloading, e.g. ``{"kv_connector": "OffloadingConnector", "kv_role":
    "kv_both", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 1073741824, "eviction_policy": "lru", "secondary_tiers": [{"type":
    "fs", "root_dir": "/mnt/kv-cache-0"}]}}`` (engine/kserve_paged_engine/config/kv_tier.py)."""
    try:
        return KVTierConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative_config``: vLLM's JSON, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or
    ``{"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}``."""
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class BoolFlag(argparse.Action):
    """``--flag`` sets True, ``--no_flag`` sets False, and (KServe style) ``--flag=false`` works."""

    def __init__(self, option_strings, dest, default=None, help=None, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=default, help=help,
                         metavar="BOOL", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        no = negated(option_string)
        if values is None or str(values).lower() in _TRUE:
            value = True
        elif str(values).lower() in _FALSE:
            value = False
        else:
            parser.error(f"{option_string}: expected a boolean, got {values!r}")
        setattr(namespace, self.dest, (not value) if no else value)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_lora_module(text: str) -> tuple[str, str]:
    """``--lora_modules`` entry: ``NAME=PATH``, or vLLM's JSON object ``{"name": ..., "path":
    ..., "base_model_name": ...}``, with or without the single quotes KServe's controller
    wraps it in. ``base_model_name`` is accepted and not used: vLLM shows it as the adapter's
    parent in /v1/models, and here the parent is always the one served model."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        text = text[1:-1].strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON ({exc}): {text!r}") from None
        unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else ()
        if (not isinstance(entry, dict) or unknown or not isinstance(entry.get("name"), str)
                or not isinstance(entry.get("path"), str) or not entry["name"].strip()
                or not entry["path"].strip()):
            raise argparse.ArgumentTypeError(
                "--lora-modules: a JSON entry needs string \"name\" and \"path\" (and may "
                f"have \"base_model_name\"), got {text!r}")
        return entry["name"].strip(), entry["path"].strip()
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {text!r}")
    return name.strip(), path.strip()
