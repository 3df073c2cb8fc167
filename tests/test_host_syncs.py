"""One host sync per engine step on the GPU path (issue 32, item 4).

`bench/host_syncs.py`'s `run` steps the engine on the Triton backend (in the session's GPU-path
worker, tests/helpers/gpu_path_worker.py: Triton interpreted without CUDA) and counts, by call site, every host read of a tensor
(`.item()`, `.tolist()`, `bool()`, ...) and pageable `torch.tensor(list, device=)` the
project's code makes in the device part of one step (tests/helpers/host_reads.py). The count
is held at one: the read-back of the sampled ids (engine/kserve_paged_engine/model_executor/host_io.py), in
prefill, decode, an n=2 fork's copy-on-write, Mixtral's routed experts and top-p sampling.
"""

from __future__ import annotations

import pytest
import torch

from kserve_paged_engine.model_executor.host_io import ReadBack, upload
from kserve_paged_engine.sample.sampler import Sampler, make_generator
from kserve_paged_engine.sampling_params import SamplingParams
from tests.helpers.gpu_path_worker import GpuPathWorker
from tests.helpers.host_reads import host_reads

READ_BACK = "engine/kserve_paged_engine/model_executor/host_io.py"


CASES = ["prefill", "decode", "fork", "moe", "sampled"]


@pytest.fixture
def counts(gpu_path: GpuPathWorker) -> dict:
    return gpu_path.call("host_syncs", "run", cases=CASES)


@pytest.mark.parametrize("case", CASES)
def test_one_host_read_per_step(counts: dict, case: str) -> None:
    result = counts[case]
    assert result["total"] == 1, result["sites"]
    (site,) = result["sites"]
    assert site.startswith(READ_BACK) and site.endswith("tolist")


def test_the_counter_sees_project_reads_and_uploads_only() -> None:
    t = torch.arange(4)
    with host_reads() as reads:
        assert ReadBack().tokens(t) == [0, 1, 2, 3]  # a project file's tolist: counted
        assert int(t.sum()) == 6 and t.tolist()  # this test's own reads: not counted
        import kserve_paged_engine.sample.draw as draw

        vals = torch.tensor([[0.5, 0.3, 0.2]])
        one = torch.ones(1)
        draw.cutoffs(vals, torch.zeros(1, dtype=torch.long), one * 0.5, one * 0, True)
        draw.cutoffs(vals, torch.zeros(1, dtype=torch.long), one * 0.5, one * 0, True,
                     any_p=True)  # told on the host: no read
    where = sorted((site.split(":")[0], site.split()[-1]) for site in reads.sites)
    assert where == [("engine/kserve_paged_engine/model_executor/host_io.py", "tolist"),
                     ("engine/kserve_paged_engine/sample/draw.py", "bool")]


def test_upload_keeps_values_and_dtype() -> None:
    t = upload([3, 1, 2], torch.long, "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
    assert upload([0.5], torch.float32, torch.device("cpu")).dtype == torch.float32


def test_full_sort_draws_the_ladders_tokens() -> None:
    """The GPU path's sampler (`ladder=False`: filtered rows sorted in full, no host read)
    draws what the ladder draws for the same seeds: the cut-off and the cumulative sums over
    the kept tokens in vocabulary order are the same numbers."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.0,
                                                                          top_k=7),
              SamplingParams(temperature=0.7, min_p=0.05), SamplingParams(temperature=1.2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_p=0.95,
                                                              top_k=100)]
    got = []
    for ladder in (True, False):
        for _ in range(2):
            gens = [make_generator(10 + i) for i in range(6)]
            got.append(Sampler(0, ladder=ladder).sample(logits, params, gens, [5] * 6,
                                                        [None] * 6).tolist())
    assert got[0] == got[1] == got[2] == got[3]


# Reads made inside torch's C++, each as a project file would make it (compiled under a file name
# in engine/, which is what the counter attributes by): no Python method is called for them.
CPP_READS = {
    "bincount": "torch.bincount(ids, minlength=4)",  # what the fused MoE's routing once did
    "nonzero": "ids.nonzero()",
    "index[bool mask]": "ids[ids > 1]",
    "repeat_interleave(tensor repeats)": "torch.repeat_interleave(torch.arange(4), ids)",
    "item": "ids.narrow(0, torch.tensor(1), 2)",  # a tensor start: .item() in C++
    "unique": "torch.unique(ids)",
    "masked_select": "ids.masked_select(ids > 0)",
    "equal": "torch.equal(ids, ids)",
}
NO_READ = [
    "torch.zeros(4, dtype=torch.long).scatter_add_(0, ids, torch.ones_like(ids))",
    "torch.repeat_interleave(torch.arange(4), ids, output_size=5)",
    "ids[torch.tensor([0, 2])]",  # integer indices: a gather, no read
    "torch.where(ids > 0, ids, -1)",
]


def _as_project_code(src: str) -> None:
    from tests.helpers.host_reads import ROOT

    code = compile(src, str(ROOT / "engine/kserve_paged_engine/_probe.py"), "eval")
    eval(code, {"torch": torch, "ids": torch.tensor([1, 0, 2, 2])})


@pytest.mark.parametrize("name", sorted(CPP_READS))
def test_the_counter_sees_reads_made_inside_torch(name: str) -> None:
    with host_reads() as reads:
        _as_project_code(CPP_READS[name])
        _as_project_code(CPP_READS[name].replace("ids", "ids.clone()"))
    assert reads.sites == {f"engine/kserve_paged_engine/_probe.py:1 {name}": 2}


def test_the_counter_leaves_device_side_ops_and_torchs_own_reads_alone() -> None:
    with host_reads() as reads:
        for src in NO_READ:
            _as_project_code(src)
        torch.bincount(torch.tensor([1, 0, 2]))  # this test's own op: not counted
        assert bool(torch.ones(1)) and torch.ones(1).item() == 1.0
    assert reads.sites == {}


def test_a_python_read_is_counted_once() -> None:
    """`.item()` / `bool()` from a project file: the patched method counts it, not also the
    `_local_scalar_dense` it dispatches."""
    with host_reads() as reads:
        _as_project_code("torch.ones(1).item() + bool(torch.ones(1))")
    assert reads.sites == {"engine/kserve_paged_engine/_probe.py:1 item": 1,
                           "engine/kserve_paged_engine/_probe.py:1 bool": 1}


def test_mean_pooling_a_step_reads_nothing_back() -> None:
    """The step's rows to their chunks' segment ids: `repeat_interleave` told its output's
    length (the rows), so it does not read the lengths back (only their upload is seen)."""
    from kserve_paged_engine.model_executor.pooler import chunk_parts

    hidden = torch.randn(7, 4)
    with host_reads() as reads:
        out = chunk_parts("mean", hidden, [3, 4])
    torch.testing.assert_close(out, torch.stack([hidden[:3].sum(0), hidden[3:].sum(0)]))
    assert {site.split(" ", 1)[1] for site in reads.sites} == {"tensor(list, device=)"}
