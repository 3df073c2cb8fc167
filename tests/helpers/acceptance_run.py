"""bench/gpu_acceptance.py's modules as its tests import them, and fake stages for the tests
of its run loop (tests/test_gpu_acceptance*.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """A module of bench/ (a script or one of the acceptance package's), imported as the
    scripts import each other: with bench/ on the path."""
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def acceptance_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(gpu_acceptance, acceptance.stages, acceptance.runner)."""
    return (bench_module("gpu_acceptance"), bench_module("acceptance.stages"),
            bench_module("acceptance.runner"))


def fake_stages(monkeypatch: pytest.MonkeyPatch, specs: list[tuple],
                preflight_passes: bool = True) -> None:
    """STAGES as `(name, python code, budget[, Part keywords])`, one part each; with
    `preflight_passes` a preflight that passes at once, without it the real one."""
    _, stages, runner = acceptance_modules()
    preflight = bench_module("acceptance.preflight")

    def stage(name: str, code: str, budget: int, kw: dict[str, Any] | None = None) -> Any:
        part = runner.Part(name, [sys.executable, "-c", code], **(kw or {}))
        return runner.Stage(name, name, budget, budget, lambda ctx, folder: [part])

    monkeypatch.setattr(stages, "STAGES", [stage(*spec) for spec in specs])
    if preflight_passes:
        monkeypatch.setattr(preflight, "stage", lambda: stage(
            "preflight", "print('{\"ok\": true}')", 10,
            {"parse_json": True, "judge": preflight._judge}))
        monkeypatch.setattr(preflight, "one_line", lambda result: f"preflight: {result['status']}")
        monkeypatch.setattr(preflight, "toolchain_problem", lambda env=None: None)
