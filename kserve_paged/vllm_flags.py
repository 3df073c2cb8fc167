"""vLLM's spellings of our flags: the command lines KServe's LLMInferenceService and users write.

Why: KServe's LLMInferenceService presets run `vllm serve /mnt/models --served-model-name ...
--port 8000 ...` and users copy flags from vLLM's docs, all in dash spelling. Our flags follow
KServe's underscore spelling. Every flag therefore answers to both (`--max_model_len` and
`--max-model-len`), and `VLLM_FLAGS` is the one table of vLLM flags whose name differs from
ours. `--help` lists both spellings. A flag neither spelling knows stays an error that names it.
"""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

# The vLLM release whose `serve` flags this command line follows. It ends `vllm --version`'s
# output because KServe's preset reads that last word to pick its flags: from 0.16
# --disable-access-log-for-endpoints, from 0.18 --shutdown-timeout, from 0.22
# --kv-transfer-config for spec.kvCacheOffloading (the second KV tier, engine/kserve_paged_engine/core/kv_tier/disk.py).
VLLM_CLI_VERSION = "0.22.0"


def package_version() -> str:
    try:
        return version("kserve-paged")
    except PackageNotFoundError:
        return "0+unknown"


# vLLM's flag -> our flag, where the names differ beyond '-' versus '_'.
VLLM_FLAGS: dict[str, str] = {
    "--port": "--http_port",
    "--host": "--http_host",
    "--shutdown-timeout": "--shutdown_grace_s",
}


def _alias(parser: argparse.ArgumentParser, action: argparse.Action, spelling: str) -> None:
    """Make `spelling` one more option string of `action` (shown by --help). KServe's flags
    come as its parser's own action objects (argparse shares a parent's actions), so a second
    parser built in the same process finds the spelling already on the action."""
    if spelling in parser._option_string_actions:
        return
    if spelling not in action.option_strings:
        action.option_strings.append(spelling)
    parser._option_string_actions[spelling] = action


def add_vllm_spellings(parser: argparse.ArgumentParser) -> None:
    """Give every `--a_b` flag its `--a-b` spelling and every vLLM name of `VLLM_FLAGS` its
    flag. Call once the parser has all its flags."""
    for action in list(parser._actions):
        for option in list(action.option_strings):
            if option.startswith("--") and "_" in option:
                _alias(parser, action, option.replace("_", "-"))
    for vllm, ours in VLLM_FLAGS.items():
        _alias(parser, parser._option_string_actions[ours], vllm)


def negated(option_string: str | None) -> bool:
    """True for a `--no_x` / `--no-x` spelling of a boolean flag."""
    return option_string is not None and option_string.startswith(("--no_", "--no-"))
