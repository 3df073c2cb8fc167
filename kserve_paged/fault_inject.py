"""Test-only fault injection for the server (never set it in production).

Why: the reliability tests must prove that a failing engine step fails only its own requests
and that a dead engine thread turns readiness and liveness false, against the real server
process. ``LLMEngine.fault_hook`` is called with each step's request ids before the forward;
this module connects it to a control file named by ``KSERVE_PAGED_FAULT_INJECT``.

The test writes one word into the file; the next engine step consumes it (the file is emptied):

- ``step``: that step raises ``InjectedFault`` (an ``Exception``), which the engine contains: the
  step's requests end with an error, the engine goes on.
- ``fatal``: that step raises ``InjectedFatalFault`` (a ``BaseException``), which escapes the
  step's containment and kills the engine thread, as an unrecoverable failure would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kserve_paged_kernels import settings

ENV_VAR = settings.FAULT_INJECT.name

logger = logging.getLogger("kserve.paged")


class InjectedFault(RuntimeError):
    """A contained failure of one engine step."""


class InjectedFatalFault(BaseException):
    """A failure no step containment catches: the engine thread dies."""


class FileFaultHook:
    """``LLMEngine.fault_hook`` driven by a control file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __call__(self, request_ids: list[str]) -> None:
        try:
            command = self.path.read_text().strip()
        except OSError:
            return
        if not command:
            return
        self.path.write_text("")  # one shot
        logger.warning("fault injection: %r in a step of %d request(s)", command,
                       len(request_ids))
        if command == "step":
            raise InjectedFault(f"injected fault in a step of {len(request_ids)} request(s)")
        if command == "fatal":
            raise InjectedFatalFault("injected fatal fault: the engine thread dies")
        logger.error("fault injection: unknown command %r (expected step or fatal)", command)


def engine_factory_from_env(config: Any) -> Callable[[], Any] | None:
    """An AsyncLLM ``engine_factory`` that installs the hook, when the env var is set."""
    path = settings.fault_inject_path()
    if not path:
        return None
    logger.warning("TEST-ONLY fault injection is on (%s=%s)", ENV_VAR, path)

    def build() -> Any:
        from kserve_paged_engine.frontend.llm_engine import LLMEngine

        engine = LLMEngine(config)
        engine.fault_hook = FileFaultHook(path)
        return engine

    return build
