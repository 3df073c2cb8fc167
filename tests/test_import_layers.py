"""The layers of the code, pinned (docs/architecture.md draws them).

From the top: the server (kserve_paged/), the engine's front (engine/*.py: LLM, AsyncLLM,
LLMEngine and what turns requests into steps and steps into outputs), speculation, the worker
(model runner and executors), the core (scheduler, requests, KV cache), sampling, the model
executor (layers, models, loader; LoRA beside it), communication and the request definitions
every layer shares, and the kernels. A file may import its own layer and those below, never
one above; no files import each other in a loop, function-level and annotation-only imports
included.
"""

from __future__ import annotations

import pytest

from tests.helpers.import_graph import circles, import_graph, project_files

# Top first. A file belongs to the layer of the longest path that contains it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("server", ("kserve_paged/",)),
    ("front", ("engine/",)),
    ("speculation", ("engine/kserve_paged_engine/spec_decode/",)),
    ("worker", ("engine/kserve_paged_engine/worker/",)),
    ("core", ("engine/kserve_paged_engine/core/",)),
    ("sample", ("engine/kserve_paged_engine/sample/",)),
    ("model_executor", ("engine/kserve_paged_engine/model_executor/", "engine/kserve_paged_engine/lora/")),
    ("shared", ("engine/kserve_paged_engine/distributed/", "engine/kserve_paged_engine/sampling_params.py", "engine/kserve_paged_engine/pooling_params.py",
                "engine/kserve_paged_engine/limits.py",
                "engine/kserve_paged_engine/outputs.py")),
    ("kernels", ("kernels/",)),
]
RANK = {name: len(LAYERS) - i for i, (name, _) in enumerate(LAYERS)}


def layer_of(file: str) -> str:
    best = max(((len(p), name) for name, paths in LAYERS for p in paths if file.startswith(p)),
               default=None)
    assert best is not None, f"{file} is in no layer: add it to LAYERS"
    return best[1]


GRAPH = import_graph()


def test_every_file_has_a_layer() -> None:
    assert {layer_of(f) for f in project_files()} == set(RANK)


def test_nothing_imports_upward() -> None:
    upward = [f"{i.source}:{i.line} ({layer_of(i.source)}) imports {i.target} "
              f"({layer_of(i.target)})"
              for imports in GRAPH.values() for i in imports
              if RANK[layer_of(i.target)] > RANK[layer_of(i.source)]]
    assert upward == []


@pytest.mark.parametrize("lower, upper", [("engine/", "kserve_paged/"), ("kernels/", "engine/"),
                                          ("kernels/", "kserve_paged/")])
def test_lower_packages_never_import_upper_ones(lower: str, upper: str) -> None:
    assert [f"{i.source}:{i.line} -> {i.target}" for imports in GRAPH.values() for i in imports
            if i.source.startswith(lower) and i.target.startswith(upper)] == []


def test_the_runner_knows_no_other_process() -> None:
    """Tensor parallelism is the executor's business (engine/kserve_paged_engine/worker/tp_executor.py)."""
    assert [i.target for i in GRAPH["engine/kserve_paged_engine/worker/model_runner.py"]
            if i.target.startswith("engine/kserve_paged_engine/distributed/")] == []


def test_no_circles() -> None:
    assert circles(GRAPH) == []


def test_the_checks_see_an_upward_import_and_a_circle() -> None:
    """The graph is read from the source: a planted upward import and a loop are found."""
    from tests.helpers.import_graph import Import

    planted = dict(GRAPH)
    planted["kernels/kserve_paged_kernels/settings.py"] = [*GRAPH["kernels/kserve_paged_kernels/settings.py"],
                                      Import("kernels/kserve_paged_kernels/settings.py", "engine/kserve_paged_engine/llm.py", 1)]
    assert RANK[layer_of("engine/kserve_paged_engine/llm.py")] > RANK[layer_of("kernels/kserve_paged_kernels/settings.py")]
    assert any("kernels/kserve_paged_kernels/settings.py" in group for group in circles(planted))
