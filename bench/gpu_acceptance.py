"""The GPU acceptance run (issue 32, item 7; issue 48): one command, a preflight, then stages
with their own time limits, one JSON file per stage under --out, no stop at a failure.

    python bench/gpu_acceptance.py --out DIR [--stages a,b] [--cache-dir DIR] [--dry-run]
    python bench/gpu_acceptance.py --preflight [--out DIR]
    python bench/gpu_acceptance.py --plan [--dry-run]

Made for a minimal GPU image: Python 3.12, torch 2.11, triton 3.6, transformers 5.17, no
network, neither kserve nor gguf nor (maybe) pytest, nothing of ours but this repository tree.
So this process imports only the standard library, and each stage is one or more child
processes with the tree on PYTHONPATH: a crash or a hang costs that stage, not the run.

- The preflight (bench/acceptance/preflight.py) runs first: a C compiler and `Python.h` for
  Triton's launchers, then one kernel compiled and launched on the GPU, in well under a minute.
  When it fails, one line says why and nothing else runs (exit status 3). `--preflight` runs
  it alone.
- The stages (bench/acceptance/stages.py, most informative first; `--plan` prints them with
  their limits and the total, under 9 minutes on one H200): each has its own limit, never
  lengthened or shortened by another's (bench/acceptance/runner.py). The children share one
  Triton cache (--cache-dir), so a kernel compiled by one stage is warm for the next; the
  kernel tests run under a pytest carried in this tree, in shards side by side
  (bench/acceptance/kernel_tests.py).
- Each stage's JSON (`DIR/<stage>.json`) is rewritten while it runs: each part's tests so far
  and its output's tail, so a stage killed at its limit, or a run killed from outside, still
  says what passed. `DIR/summary.json` lists each stage's status, also as the run goes
  (`complete` false until the end); `DIR/logs/` holds every child's whole output.

`--dry-run` runs everything on CPU, Triton in its interpreter, at tiny sizes, with limits of
its own (tests/test_gpu_acceptance.py runs it). Exit status 0 when every stage passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from acceptance import preflight
from acceptance.kernel_tests import LEFT_OUT
from acceptance.runner import Context, Stage, run_stage
from acceptance.stages import LIMIT_S, STAGES, plan, plan_text

PREFLIGHT_FAILED = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the stages' JSON files")
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on CPU, Triton interpreted, tiny sizes")
    parser.add_argument("--stages", help=f"comma-separated subset of "
                                         f"{', '.join(s.name for s in STAGES)}")
    parser.add_argument("--preflight", action="store_true",
                        help="only the preflight: can Triton compile and launch on the GPU")
    parser.add_argument("--plan", action="store_true",
                        help="print the stages, their limits and the total; run nothing")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kserve-paged-acceptance-triton",
                        help="Triton cache shared by the stages")
    parser.add_argument("--stage-preflight", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not (args.stage_preflight or args.plan or args.preflight):
        parser.error("--out is required")
    return args


def _writer(path: Path):
    """Write a JSON file whole (a reader never sees half of one)."""
    def write(data: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    return write


def _run_preflight(ctx: Context, out: Path, step: tuple[Stage, int],
                   summary: dict[str, Any]) -> bool:
    """The preflight, its one line printed; False when the run must stop."""
    if not ctx.dry_run and (problem := preflight.toolchain_problem()):
        result = {"stage": "preflight", "status": "fail", "why": problem, "seconds": 0.0}
        _writer(out / "preflight.json")(result)
        line = f"preflight failed: {problem}"
    else:
        stage, limit = step
        result = run_stage(stage, ctx, out / "logs" / stage.name, limit,
                           _writer(out / f"{stage.name}.json"))
        line = preflight.one_line(result)
    summary["preflight"] = line
    print(line, flush=True)
    return result["status"] == "pass"


def run(args: argparse.Namespace, steps: list[tuple[Stage, int]]) -> int:
    """The preflight, then each stage in turn under its own limit from `steps` (the plan:
    the preflight first); the summary as it goes."""
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="preflight-"))
    out.mkdir(parents=True, exist_ok=True)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(dry_run=args.dry_run, cache_dir=args.cache_dir)
    write_summary = _writer(out / "summary.json")
    summary: dict[str, Any] = {"dry_run": args.dry_run, "plan_s": sum(s for _, s in steps),
                               "limit_s": LIMIT_S, "complete": False, "stages": {},
                               "left_out": LEFT_OUT}
    t0 = time.monotonic()
    ok = _run_preflight(ctx, out, steps[0], summary)
    summary["ok"] = ok
    summary["complete"] = not ok  # a failed preflight ends the run
    write_summary(summary)
    if not ok:
        return PREFLIGHT_FAILED
    for stage, limit in [] if args.preflight else steps[1:]:
        result = run_stage(stage, ctx, out / "logs" / stage.name, limit,
                           _writer(out / f"{stage.name}.json"))
        summary["stages"][stage.name] = result["status"]
        summary["seconds"] = round(time.monotonic() - t0, 1)
        write_summary(summary)
        print(f"{stage.name}: {result['status']} in {result['seconds']} s"
              + (f" ({result['why'][:300]})" if result.get("why") else ""), flush=True)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["complete"] = True
    summary["ok"] = all(s == "pass" for s in summary["stages"].values())
    write_summary(summary)
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage_preflight:
        report = preflight.child()
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    names = args.stages.split(",") if args.stages else None
    unknown = set(names or []) - {s.name for s in STAGES}
    if unknown:
        print(f"unknown stages: {sorted(unknown)}", file=sys.stderr)
        return 2
    steps = plan(names, args.dry_run)
    if args.plan:
        print(plan_text(steps, args.dry_run))
        return 0
    return run(args, steps)


if __name__ == "__main__":
    sys.exit(main())
