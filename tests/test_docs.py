"""The docs cannot drift from the code: docs/architecture.md traces a streamed chat completion
as the code runs it, and every path the docs name exists.

The trace is checked against a real request: the default model served in process, one streamed
chat completion followed through every thread it touches (the event loop's, the engine's) with
`sys.setprofile`, and every project file a call enters must be named in the trace.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.server import NAME, build, client

REPO = Path(__file__).resolve().parents[1]
# The design docs (BENCHMARKS.md and RELIABILITY.md are records of past runs: they name files
# as they were then).
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "bench" / "README.md"]
ROOTS = ("engine", "kernels", "kserve_paged", "tests", "scripts", "bench", "docs", "manifests",
         "e2e")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")/[\w./*-]*)")
FILE_SUFFIXES = (".py", ".md", ".c", ".h", ".sh", ".yaml", ".yml", ".json", ".toml", ".txt")
CODE = ("engine/", "kernels/", "kserve_paged/")


def named_paths(text: str) -> set[str]:
    """Repository paths a text names; `dir/module.name` (a module's attribute) names
    `dir/module.py`; globs are left out."""
    found = set()
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,:;)")
        if "*" in path:
            continue
        last = path.rsplit("/", 1)[-1]
        if "." in last and not last.endswith(FILE_SUFFIXES):
            path = path[:len(path) - len(last)] + last.split(".")[0] + ".py"
        found.add(path)
    return found


def trace_section() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## The path of a streaming chat completion")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_every_path_the_docs_name_exists() -> None:
    missing = sorted(f"{doc.relative_to(REPO)}: {path}" for doc in DOCS
                     for path in named_paths(doc.read_text())
                     if not (REPO / path.rstrip("/")).exists())
    assert missing == []


def test_the_path_check_sees_a_missing_path() -> None:
    assert named_paths("see `engine/no_such_file.py`, and engine/kserve_paged_engine/core/ here") == {
        "engine/no_such_file.py", "engine/kserve_paged_engine/core/"}
    assert named_paths("engine/kserve_paged_engine/core/kv_sizing.kv_budget_bytes, e2e/test_*.py") == {
        "engine/kserve_paged_engine/core/kv_sizing.py"}


def entered_files(entered: set[str]):
    """A profile function that records the project files whose code a call enters."""
    root = str(REPO) + "/"

    def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and name[len(root):].startswith(CODE):
                entered.add(name[len(root):])
    return profile


@pytest.mark.slow
def test_a_streamed_chat_completion_enters_only_files_the_trace_names() -> None:
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.default_model import ensure_default_model
    from kserve_paged_engine.frontend.llm_engine import LLMEngine

    path = str(ensure_default_model(progress=lambda _: None))
    app, model = build(factory=lambda: LLMEngine(EngineConfig(
        model=path, max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=256)))
    entered: set[str] = set()
    profile = entered_files(entered)

    async def main() -> str:
        await model.start_engine()
        await model.llm.call_engine(lambda _: sys.setprofile(profile))
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            async with client(app) as c:
                r = await c.post("/openai/v1/chat/completions", json={
                    "model": NAME, "messages": [{"role": "user", "content": "Hi!"}],
                    "max_tokens": 4, "stream": True})
                await asyncio.sleep(0)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            await model.llm.call_engine(lambda _: sys.setprofile(None))
            model.stop_engine()
        return r.text

    body = asyncio.run(asyncio.wait_for(main(), 600))  # loading the model takes a while
    assert body.rstrip().endswith("data: [DONE]")
    assert {"engine/kserve_paged_engine/core/scheduler.py", "kserve_paged/openai/chat.py"} <= entered
    unnamed = sorted(entered - named_paths(trace_section()))
    assert unnamed == [], f"entered but not in docs/architecture.md's trace: {unnamed}"
