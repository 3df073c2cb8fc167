"""The layers of the code, pinned as folders (docs/architecture.md draws them).

From the top: the server (kserve_paged/), the engine's front (frontend/: LLM, AsyncLLM, LLMEngine's
step and its stages), speculation, the worker (model runner and executors), the core (scheduler,
requests, KV cache and its second tier), sampling, the model executor (layers, models, loader,
weight formats; LoRA beside it), the options (config/), the request definitions every layer
shares (the engine package's own files) with communication between ranks, and the kernels. A
file may import its own layer and those below, never one above; no files import each other in a
loop, function-level and annotation-only imports included. The engine package's doors
(`__init__.py`'s public names, `__main__.py`'s command line) stand with the front.
"""

from __future__ import annotations

import pytest

from tests.helpers.import_graph import circles, import_graph, project_files

# Top first. A file belongs to the layer of the longest folder that holds it.
ENGINE = "engine/kserve_paged_engine/"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("server", ("kserve_paged/",)),
    ("front", (ENGINE + "frontend/",)),
    ("speculation", (ENGINE + "spec_decode/",)),
    ("worker", (ENGINE + "worker/",)),
    ("core", (ENGINE + "core/",)),
    ("sample", (ENGINE + "sample/",)),
    ("model_executor", (ENGINE + "model_executor/", ENGINE + "lora/")),
    ("config", (ENGINE + "config/",)),
    ("shared", (ENGINE, ENGINE + "distributed/")),
    ("kernels", ("kernels/",)),
]
DOORS = (ENGINE + "__init__.py", ENGINE + "__main__.py")
RANK = {name: len(LAYERS) - i for i, (name, _) in enumerate(LAYERS)}


def layer_of(file: str) -> str:
    if file in DOORS:
        return "front"
    best = max(((len(p), name) for name, paths in LAYERS for p in paths if file.startswith(p)),
               default=None)
    assert best is not None, f"{file} is in no layer: add it to LAYERS"
    return best[1]


GRAPH = import_graph()


def test_the_layers_are_folders() -> None:
    assert all(p.endswith("/") for _, paths in LAYERS for p in paths)


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
                                      Import("kernels/kserve_paged_kernels/settings.py", "engine/kserve_paged_engine/frontend/llm.py", 1)]
    assert RANK[layer_of("engine/kserve_paged_engine/frontend/llm.py")] > RANK[layer_of("kernels/kserve_paged_kernels/settings.py")]
    assert any("kernels/kserve_paged_kernels/settings.py" in group for group in circles(planted))
