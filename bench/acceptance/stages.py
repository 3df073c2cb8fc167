"""The acceptance run's stages, most informative first, each with its own budget: seconds on one
H200 from a cold Triton cache, estimated from what a cold start costs (the compiles each stage
makes, counted on CPU, times a compile's time measured on CPU; the estimate per stage and how
it was made: BENCHMARKS.md, the GPU acceptance run). A stage's parts run side by side (pytest
shards, one engine-equality child per model and dtype, the GPU-path scripts with the kernel
grid) where that shortens a stage bound by compiles, which run one at a time per process; the
timing stages run alone.

Budgets sum, with the preflight's, to under LIMIT_S: the run never outlasts it
(acceptance.runner says why). The first GPU run's `seconds` per stage replace the estimates.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acceptance import kernel_tests, preflight
from acceptance.runner import ROOT, Context, Part, Stage

LIMIT_S = 9 * 60  # the whole run on one H200, preflight included
MAX_LAUNCHES_PER_LAYER = 12
# bench/engine_equality.py's MODELS (tests/test_gpu_acceptance.py holds them equal; importing
# it here would import torch into this process).
ENGINE_MODELS = ("llama", "qwen3", "gemma3", "mixtral")
ENGINE_DTYPES = ("float32", "bfloat16")
PY = sys.executable


def _bench(script: str, *args: str) -> list[str]:
    return [PY, str(ROOT / "bench" / script), "--json", *args]


def _judge_launches(data: dict[str, Any]) -> str | None:
    llama = data["llama"]
    if llama["layer"]["total"] > MAX_LAUNCHES_PER_LAYER:
        return f"{llama['layer']['total']} launches per Llama layer > {MAX_LAUNCHES_PER_LAYER}"
    if max(r["max_abs_diff"] for r in data.values()) > 1e-4:
        return "fused step differs from the eager one"
    return None


def _judge_ok(data: dict[str, Any]) -> str | None:
    if data.get("ok"):
        return None
    failed = [k for k, r in data.get("results", data.get("splits", {})).items()
              if isinstance(r, dict) and r.get("ok") is False]
    return f"failed: {failed}" if failed else "not ok"


def _judge_syncs(data: dict[str, Any]) -> str | None:
    over = {k: v["sites"] for k, v in data.items() if isinstance(v, dict) and v["total"] != 1}
    return f"more than one host read per step: {over}" if over else None


def _scenario_lines(record: Path | None, text: str) -> dict[str, Any]:
    """bench/engine_equality.py's stderr line per scenario as it ends: `model/scenario: ok
    (1.2 s)`, or the error in place of `ok`."""
    tests: dict[str, Any] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(": ")
        if sep and key.count("/") == 1 and " " not in key and rest.endswith(" s)"):
            verdict, _, seconds = rest.rpartition(" (")
            tests[key] = {"outcome": "passed" if verdict == "ok" else "failed",
                          "seconds": float(seconds[:-3]),
                          **({} if verdict == "ok" else {"why": verdict[:500]})}
    return tests


def _kernel_tests(ctx: Context, folder: Path) -> list[Part]:
    if ctx.dry_run:
        return kernel_tests.pytest_parts(ctx, folder, kernel_tests.DRY_RUN_TESTS, None, 2)
    return kernel_tests.pytest_parts(ctx, folder, kernel_tests.KERNEL_TESTS, "not gpu_grid",
                                     kernel_tests.shard_count(False))


def _engine_equality(ctx: Context, folder: Path) -> list[Part]:
    """One child per model and dtype: each compiles its own kernels. The dry run: Llama's
    `graphs` (the cheapest interpreted) and `host-tier` (the KV tier's logic on CPU)."""
    models = ("llama",) if ctx.dry_run else ENGINE_MODELS
    scenarios = ["--scenarios", "graphs,host-tier"] if ctx.dry_run else []
    return [Part(f"{dtype}/{model}", _bench("engine_equality.py", "--dtype", dtype,
                                            "--models", model, *scenarios),
                 parse_json=True, judge=_judge_ok, progress=_scenario_lines)
            for dtype in ENGINE_DTYPES for model in models]


def _gpu_path(ctx: Context, folder: Path) -> list[Part]:
    """Three scripts and the kernel grid's shards side by side: all bound by compiles, one
    at a time per process, and none a timing."""
    dry = ctx.dry_run
    return [
        Part("host-syncs", _bench("host_syncs.py", *(["--cases", "decode"] if dry else [])),
             parse_json=True, judge=_judge_syncs),
        Part("big-kv", _bench("big_kv_check.py", *(["--tiny"] if dry else [])),
             parse_json=True, judge=_judge_ok),
        Part("launch-count", _bench("launch_count.py", *(
            ["--models", "llama", "--layers", "1"] if dry else ["--models", "llama,gemma3"])),
            parse_json=True, judge=_judge_launches),
        *kernel_tests.pytest_parts(ctx, folder, kernel_tests.GRID_TESTS, "gpu_grid",
                                   1 if dry else kernel_tests.shard_count(False), "grid"),
    ]


def _one(name: str, script: str, gpu_args: list[str], dry_args: list[str],
         judge: Callable[[Any], str | None] | None = _judge_ok) -> Callable[..., list[Part]]:
    def parts(ctx: Context, folder: Path) -> list[Part]:
        args = dry_args if ctx.dry_run else gpu_args
        return [Part(name, _bench(script, *args), parse_json=True, judge=judge)]
    return parts


# (name, what it shows, budget on one H200, budget in the dry run on 2 shared CPU cores)
STAGES = [
    Stage("kernel-tests", "the Triton kernels against their references on CUDA (pytest "
          "shards)", 70, 300, _kernel_tests),
    Stage("engine-equality", "tiny Llama, Qwen3, Gemma 3, Mixtral on the Triton backend "
          "greedy equal to transformers: fp32 exactly, bf16 to the stated bound", 95, 420,
          _engine_equality),
    Stage("gpu-path", "one host read per engine step; attention over a > 2^31-element KV "
          "cache; launches per decoder layer; the attention kernel's large grid", 60, 420,
          _gpu_path),
    Stage("attention-bw", "paged decode attention of an 8B layer against the copy bandwidth",
          35, 240, _one("attention-bw", "gpu_check.py", ["--contexts", "512,4096"],
                        ["--dry-run"], judge=None)),
    Stage("decode-8b", "Llama-3-8B-shaped decode step at batch 1-256, eager and graphed, "
          "against its memory floor", 75, 300,
          _one("decode-8b", "decode_8b.py", [], ["--tiny"])),
    Stage("decode-smol", "the default model's shape: graphs against eager at batch 1-16", 35,
          240, _one("decode-smol", "decode_8b.py", ["--shape", "smollm2"],
                    ["--shape", "smollm2", "--tiny"])),
    Stage("w1-8b", "W1 twice through the engine on the 8B shape, transformers for the ratio",
          70, 300, _one("w1-8b", "w1_8b.py", [], ["--tiny"])),
    Stage("profile-step", "one profiled decode step of the 8B shape at batch 64, eager and "
          "graphed", 30, 240, _one("profile-step", "profile_step.py", [], ["--tiny"])),
]


def plan(names: list[str] | None = None, dry_run: bool = False) -> list[tuple[Stage, int]]:
    """The stages a run executes, in order, with their limits: the preflight first, then the
    chosen stages (all when `names` is None) in STAGES' order."""
    chosen = [s for s in STAGES if names is None or s.name in names]
    return [(s, s.seconds(dry_run)) for s in [preflight.stage(), *chosen]]


def plan_text(steps: list[tuple[Stage, int]], dry_run: bool = False) -> str:
    """The plan as a table: each stage's limit and what it shows, then the total."""
    width = max(len(s.name) for s, _ in steps)
    lines = [f"{'stage':<{width}}  limit s  what it shows"]
    lines += [f"{s.name:<{width}}  {limit:7d}  {s.about}" for s, limit in steps]
    total = sum(limit for _, limit in steps)
    held = "the dry run's: CPU, not held to" if dry_run else "held to"
    lines.append(f"{'total':<{width}}  {total:7d}  ({held} the GPU run's limit, {LIMIT_S} s)")
    return "\n".join(lines)
