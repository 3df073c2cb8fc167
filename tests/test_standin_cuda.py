"""GPU semantics without a GPU (issue 48, item 2): the stand-in CUDA device.

The first half holds the mode to what CUDA does, on small cases in this process: a CPU tensor
in a device op raises (a beam search's CPU scores added to device log-probs, a CPU value
searched in a device cdf), a host read inside torch's C++ (`bincount`, `nonzero`, ...) raises
in an engine step and under graph capture, a replay re-runs the capture over new inputs, Triton
takes device tensors only. So the mode cannot silently go blind.

The second half runs engine steps on it (tests/helpers/standin_engine.py, in the session's
GPU-path worker: Triton interpreted): prefill, decode through captured graphs, a fork, seeded
sampling, beam search, n-gram speculation (greedy and rejection sampling), Mixtral's experts,
LoRA and the host KV tier, each with no error from the mode and the CPU engine's tokens; and
two bugs planted in a step, which must be reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu_path_worker import GpuPathWorker
from tests.helpers.standin_cuda import (
    ROOT,
    SYNC_SITES,
    CaptureError,
    DeviceMixError,
    HostReadError,
    StandinCuda,
    StandinTensor,
)
from tests.helpers.standin_cuda_api import require_standin
from tests.helpers.standin_engine import SCENARIOS

THIS = str(Path(__file__).resolve())


@pytest.fixture
def mode():
    """The mode, judging this file's reads as it judges the project's."""
    require_standin()
    with StandinCuda(scope=(THIS,)) as m:
        yield m


def test_device_tensors_say_cuda_and_hold_real_values(mode: StandinCuda) -> None:
    x = torch.arange(4.0, device="cuda")
    y = (x * 2)[1:]
    y[0] += 1
    assert isinstance(y, StandinTensor) and y.device == torch.device("cuda", 0)
    assert y.inner.tolist() == [3.0, 4.0, 6.0]
    host = torch.empty(3, pin_memory=True)
    host.copy_(y, non_blocking=True)  # into pinned memory without waiting: no read
    assert host.is_pinned() and host.tolist() == [3.0, 4.0, 6.0]
    assert y.cpu().device.type == "cpu"  # outside a step a read is allowed (start-up syncs)


def test_a_cpu_tensor_in_a_device_op_raises(mode: StandinCuda) -> None:
    """Beam search's kind (finding 2): CPU scores added to device log-probs."""
    logprobs = torch.zeros(2, 5, device="cuda")
    with pytest.raises(DeviceMixError, match="cuda:0 and cpu .*test_standin_cuda.py"):
        logprobs + torch.tensor([0.5, 0.25])[:, None]
    assert (logprobs + torch.tensor(0.5)).device.type == "cuda"  # a 0-dim CPU tensor: a number
    assert logprobs[torch.tensor([1, 0])].shape == (2, 5)  # CPU indices are copied over
    with pytest.raises(DeviceMixError):
        logprobs.index_select(0, torch.tensor([1]))
    assert len(mode.errors) == 2


def test_a_cpu_value_searched_in_a_device_cdf_raises(mode: StandinCuda) -> None:
    """Rejection sampling's kind (finding 2)."""
    cdf = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64).to("cuda")
    with pytest.raises(DeviceMixError, match="searchsorted"):
        torch.searchsorted(cdf, torch.tensor([0.3], dtype=torch.float64), right=True)
    on_device = torch.tensor([0.3], dtype=torch.float64, device="cuda")
    assert torch.searchsorted(cdf, on_device, right=True).inner.tolist() == [1]


def test_a_host_generator_for_device_values_raises(mode: StandinCuda) -> None:
    with pytest.raises(DeviceMixError, match="generator"):
        torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0))


READS = {
    "bincount": lambda ids: torch.bincount(ids, minlength=4),  # MoE's count (finding 1, 6)
    "nonzero": lambda ids: ids.nonzero(),
    "mask": lambda ids: ids[ids > 0],
    "unique": lambda ids: torch.unique(ids),
    "item": lambda ids: ids[0].item(),
    "bool": lambda ids: bool(ids[0]),
    "tolist": lambda ids: ids.tolist(),
    "cpu": lambda ids: ids.cpu(),
    "synchronize": lambda ids: torch.cuda.current_stream().synchronize(),
}


@pytest.mark.parametrize("read", READS)
def test_a_host_read_in_a_step_raises(mode: StandinCuda, read: str) -> None:
    """Finding 6's kind: reads made inside torch's C++ are seen like `.item()`."""
    ids = torch.tensor([0, 2, 2, 1]).to("cuda")
    READS[read](ids)  # outside a step
    with mode.steps(), pytest.raises(HostReadError, match="test_standin_cuda.py"):
        READS[read](ids)


def _read_back(ids: torch.Tensor) -> list[int]:
    return ids.tolist()


def test_a_sync_site_may_read(mode: StandinCuda) -> None:
    mode.sync_sites = {f"{Path(THIS).relative_to(ROOT)}::_read_back": "this test's read-back"}
    ids = torch.tensor([3, 1]).to("cuda")
    with mode.steps():
        assert _read_back(ids) == [3, 1]
        with pytest.raises(HostReadError):
            ids.tolist()
    assert sum(mode.reads.values()) == 1


@pytest.mark.parametrize("read", ["bincount", "item", "synchronize"])
def test_a_host_read_under_graph_capture_raises(mode: StandinCuda, read: str) -> None:
    """Finding 1's kind: at any time, CUDA refuses a sync while a graph is captured."""
    ids = torch.tensor([0, 2, 2, 1]).to("cuda")
    with pytest.raises(CaptureError, match="captured"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        READS[read](ids)
    assert mode.capture is None


def test_a_blocking_upload_under_capture_raises(mode: StandinCuda) -> None:
    with pytest.raises(CaptureError, match="host-to-device"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.tensor([1, 2], device="cuda")


def test_a_replay_reruns_the_capture_over_new_inputs(mode: StandinCuda) -> None:
    x = torch.zeros(3, device="cuda")
    scale = 2  # a host value: frozen into the graph
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        y = (x * scale).to(torch.int32) + 1  # `to` converts: a new tensor, replayed
        head = x[:2]
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    scale = 10
    graph.replay()
    assert y.inner.tolist() == [3, 5, 7] and head.inner.tolist() == [1.0, 2.0]


def test_triton_takes_device_tensors_only(mode: StandinCuda) -> None:
    jit = pytest.importorskip("triton.runtime.jit")

    class Kernel(jit.KernelInterface):
        def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.args = args

    kernel, x = Kernel(), torch.ones(2, device="cuda")
    kernel[(1,)](x, 3)
    assert type(kernel.args[0]) is torch.Tensor and kernel.args[1] == 3  # the CPU values
    with pytest.raises(DeviceMixError, match="Triton kernel"):
        kernel[(1,)](torch.ones(2), 3)


def test_the_sync_sites_name_functions_that_exist() -> None:
    for site in SYNC_SITES:
        path, function = site.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            names |= {f"{cls.name}.{n.name}" for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert function in names, f"{site}: no such function"


# The engine on the stand-in device.

TOKENS = {"greedy", "fork", "sampled", "beam", "again"}
COVERS = {  # what each scenario must have exercised, from its parts' values
    "llama": lambda p: "4" in p["replays"] and p["cow_copies"] > 0,  # 4: a padded row
    "ngram": lambda p: p["drafted"] > 0,
    "moe": lambda p: p["replays"],
    "lora": lambda p: True,
    "host-tier": lambda p: p["copier"] == ["StreamCopier", True] and p["stats"][
        "kv_host_tier_block_hits"] > 0 and p["stats"]["kv_swap_ins"] > 0,
}


@pytest.fixture(scope="module")
def results(gpu_path: GpuPathWorker) -> dict:
    if torch.cuda.is_available():
        pytest.skip("a real GPU is here: the GPU path runs on it")
    return gpu_path.call("tests.helpers.standin_engine", "run", scenarios=list(SCENARIOS))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_steps_on_the_standin_device(results: dict, scenario: str) -> None:
    res = results[scenario]
    assert "startup" not in res, f"{res['errors']}\n{res['startup']}"
    assert res["backend"] == "triton"
    values = {}
    for name, part in res["parts"].items():
        if name.startswith("planted"):
            continue
        where = f"{scenario}/{name}"
        assert "mode_errors" not in part, f"{where}: {part['mode_errors']}"
        assert "engine_failures" not in part, f"{where}: {part['engine_failures']}"
        assert "error" not in part, f"{where}: {part['error']}"
        values[name] = part["value"]
        if name in TOKENS:
            assert part["value"] == res["cpu"][name]["value"], where
    assert COVERS[scenario](values), values
    assert any(site.startswith("engine/kserve_paged_engine/model_executor/host_io.py")
               for site in res["reads"]), res["reads"]  # the step's read-back was seen


@pytest.mark.parametrize("part,error", [("planted-mix", "DeviceMixError"),
                                        ("planted-read", "HostReadError")])
def test_a_bug_planted_in_a_step_is_reported(results: dict, part: str, error: str) -> None:
    got = results["llama"]["parts"][part]
    assert got["value"] == [[[]]] and got["engine_failures"]  # the engine failed the request
    assert got["mode_errors"][0].startswith(error), got
    assert "model_runner.py::ModelRunner.execute" in got["mode_errors"][0]
