"""One stage of the acceptance run: its parts as child processes side by side under the stage's
own time limit, and the stage's JSON rewritten as they go.

Why children: a crash, a hang or a CUDA error costs its stage, not the run. Why a limit of its
own: a stage that overruns is killed at its budget and the next one starts with its whole
budget (none lends to or borrows from another), so one slow stage never starves the rest and
the run lasts at most the sum of the budgets. Why the JSON as they go: a stage killed at its
limit, or a run killed from outside, still shows each part's tests so far (`Part.progress`)
and where its output stood.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import source_roots

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.2  # how often the children are looked at
WRITE_EVERY_S = 2.0  # how often a running stage's JSON is rewritten
TAIL_CHARS = 4000


@dataclass
class Context:
    """What the stages' parts are built from: the dry run or not, and the folder of the Triton
    cache the children share (the carried pytest is unpacked there too)."""

    dry_run: bool
    cache_dir: Path


@dataclass
class Part:
    """One child of a stage: its command and extra environment (a PYTHONPATH here goes before
    the tree's), and how its output becomes data (`parse_json`: the last stdout line), a verdict
    (`judge`: None when the data pass, else why not; exit statuses in `ok_codes` pass) and its
    tests so far (`progress(record, output)`: test -> outcome, while it runs and after)."""

    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    parse_json: bool = False
    judge: Callable[[Any], str | None] | None = None
    progress: Callable[[Path | None, str], dict[str, Any]] | None = None
    record: Path | None = None
    ok_codes: tuple[int, ...] = (0,)


@dataclass
class Stage:
    """A stage: what it shows (`about`), its time limit in seconds on the GPU (`budget`) and in
    the dry run (`dry_budget`), and its parts, built when it starts (`parts(ctx, folder)`;
    `folder` holds the children's output)."""

    name: str
    about: str
    budget: int
    dry_budget: int
    parts: Callable[[Context, Path], list[Part]]

    def seconds(self, dry_run: bool) -> int:
        return self.dry_budget if dry_run else self.budget


def _settings() -> Any:
    """kernels/kserve_paged_kernels/settings.py, the home of our environment variables, loaded
    by path: it imports only the standard library, and this process imports nothing else."""
    name = "kserve_paged_acceptance_settings"
    if name not in sys.modules:
        path = ROOT / "kernels" / "kserve_paged_kernels" / "settings.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def child_env(ctx: Context, extra: dict[str, str]) -> dict[str, str]:
    """A child's environment: the tree's source roots on PYTHONPATH (after `extra`'s), the
    shared Triton cache, no hub, and the native CPU library off: the CPU ops would otherwise
    build it (gcc, minutes) inside a timed stage before they look at the tensors' device."""
    env = dict(os.environ)
    paths = [extra["PYTHONPATH"]] if extra.get("PYTHONPATH") else []
    paths += source_roots(ROOT) + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update({k: v for k, v in extra.items() if k != "PYTHONPATH"})
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["TRITON_CACHE_DIR"] = str(ctx.cache_dir)
    env[_settings().NATIVE.name] = "0"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if ctx.dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path even on a GPU host
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _tail(path: Path, chars: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
        return f.read().decode(errors="replace")[-chars:]


class _Child:
    """One running part: its process (leading its own group, killed whole: pytest's children
    or a compiler left behind would hold on past the limit) and its output files."""

    def __init__(self, part: Part, ctx: Context, folder: Path) -> None:
        self.part = part
        stem = str(folder / part.name.replace("/", "-"))
        self.out, self.err = Path(stem + ".out"), Path(stem + ".err")
        self.t0 = time.monotonic()
        self.ended: float | None = None
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(part.cmd, cwd=ROOT, env=child_env(ctx, part.env),
                                         stdout=out, stderr=err, start_new_session=True)

    def running(self) -> bool:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is None

    def view(self) -> dict[str, Any]:
        """What is known now: the command, the tests so far and the output's tail."""
        view: dict[str, Any] = {"cmd": " ".join(self.part.cmd),
                                "status": "running" if self.running() else "exited"}
        if self.part.progress is not None:
            text = self.out.read_text(errors="replace") + self.err.read_text(errors="replace")
            view["tests"] = self.part.progress(self.part.record, text)
        view["output_tail"] = (_tail(self.out, TAIL_CHARS) + "\n[stderr]\n"
                               + _tail(self.err, TAIL_CHARS))
        return view

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self, killed: bool) -> dict[str, Any]:
        """The part's verdict once its process is gone: timeout, fail, error or pass."""
        view = self.view()
        end = time.monotonic() if killed else (self.ended or time.monotonic())
        view["seconds"] = round(end - self.t0, 1)
        view["rc"] = None if killed else self.proc.returncode
        if killed:
            view["status"] = "timeout"
            for fields in view.get("tests", {}).values():
                if fields.get("outcome") == "running":
                    fields["outcome"] = "killed"  # the test it was in at the limit
            return view
        status, why = ("pass", None) if view["rc"] in self.part.ok_codes else (
            "fail", f"exit status {view['rc']}")
        if self.part.parse_json:
            lines = self.out.read_text(errors="replace").strip().splitlines()
            try:
                view["data"] = json.loads(lines[-1])
            except (ValueError, IndexError) as exc:
                status, why = ("error", f"no JSON on the last line of stdout: {exc}") \
                    if status == "pass" else (status, why)
        if status == "pass" and self.part.judge is not None:
            why = self.part.judge(view["data"])
            status = "fail" if why else "pass"
        view["status"] = status
        if why:
            view["why"] = why
        return view


def _verdict(parts: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    statuses = [p["status"] for p in parts.values()]
    status = next((s for s in ("timeout", "fail", "error") if s in statuses), "pass")
    whys = [f"{name}: {p.get('why', p['status'])}" for name, p in parts.items()
            if p["status"] != "pass"]
    return status, "; ".join(whys)[:1500] or None


def _counts(parts: dict[str, dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(t["outcome"] for p in parts.values()
                        for t in p.get("tests", {}).values()))


def run_stage(stage: Stage, ctx: Context, folder: Path, limit: int,
              write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run `stage`'s parts side by side for at most `limit` seconds (its budget: the run
    passes nothing on from one stage to the next), `write` its JSON every WRITE_EVERY_S while
    they run and once at the end, and return it; never raises for the stage's own failure."""
    result: dict[str, Any] = {"stage": stage.name, "about": stage.about, "timeout_s": limit,
                              "status": "running", "parts": {}}
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        children = [_Child(part, ctx, folder) for part in stage.parts(ctx, folder)]
    except Exception as exc:  # noqa: BLE001 - a stage that cannot start is its own failure
        result.update(status="error", why=f"{type(exc).__name__}: {exc}", seconds=0.0)
        write(result)
        return result
    written = 0.0
    while any(c.running() for c in children) and time.monotonic() - t0 < limit:
        if time.monotonic() - written >= WRITE_EVERY_S:
            result["seconds"] = round(time.monotonic() - t0, 1)
            result["parts"] = {c.part.name: c.view() for c in children}
            result["tests"] = _counts(result["parts"])
            write(result)
            written = time.monotonic()
        time.sleep(POLL_S)
    late = [c.running() for c in children]
    for child in children:  # the finished ones too: whatever they left behind
        child.kill()
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["parts"] = {c.part.name: c.finish(killed) for c, killed in zip(children, late)}
    result["tests"] = _counts(result["parts"])
    result["status"], why = _verdict(result["parts"])
    if why:
        result["why"] = why
    write(result)
    return result
