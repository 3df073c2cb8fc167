"""The docs cannot drift from the code: docs/architecture.md traces a streamed chat completion
as the code runs it, and every path the docs name exists.

The trace is checked against a real request: the default model served in process, on the default
settings (4-bit from its GGUF) and in float32, one streamed chat completion followed through every
thread it touches (tests/helpers/request_trace.py), and every project file a call enters must be
named in the trace.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The design docs (BENCHMARKS.md and RELIABILITY.md are records of past runs: they name files
# as they were then).
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "bench" / "README.md"]
ROOTS = ("engine", "kernels", "kserve_paged", "tests", "scripts", "bench", "docs", "manifests",
         "e2e")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")/[\w./*-]*)")
FILE_SUFFIXES = (".py", ".md", ".c", ".cpp", ".h", ".sh", ".yaml", ".yml", ".json", ".toml",
                 ".txt")


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


# A streamed chat on the default settings crosses at most this many project Python files (the
# C kernels it calls are named in the trace too, but a profile cannot see into them). 45 until
# issue 49 added five jobs to the path, one file each: model control's guard, the request caps,
# the generation_config defaults (split from request_options.py), the one submission of an
# OpenAI route's prompts, and the token filters prepared once per request. 51 since issue 49's
# body decoder (a large body parsed off the server's GIL; a small one passes through it too).
MAX_FILES = 51


@pytest.mark.slow
@pytest.mark.parametrize("settings", ["default", "float32"])
def test_a_streamed_chat_completion_enters_only_files_the_trace_names(settings: str) -> None:
    """The default settings serve the default model 4-bit from its GGUF; float32 serves its
    dense folder. Both paths are named in the trace, and the default one is held at MAX_FILES
    (`python scripts/request_files.py` prints the list)."""
    from tests.helpers.request_trace import default_config, float32_config, streamed_chat_files

    config = default_config() if settings == "default" else float32_config()
    entered, body = streamed_chat_files(config)
    assert body.rstrip().endswith("data: [DONE]")
    assert {"engine/kserve_paged_engine/core/scheduler.py", "kserve_paged/openai/chat.py"} <= entered
    unnamed = sorted(entered - named_paths(trace_section()))
    assert unnamed == [], f"entered but not in docs/architecture.md's trace: {unnamed}"
    if settings == "default":
        assert len(entered) <= MAX_FILES, sorted(entered)
