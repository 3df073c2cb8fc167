"""Triton fused MoE (kernels/kserve_paged_kernels/moe_triton.py) against kserve_paged_kernels.reference.fused_moe_ref.

Without CUDA the kernels run in Triton's interpreter (the `triton_interpreter` fixture; the
kernels call triton_backend's helpers, so both are loaded); shapes are kept small so the
interpreter finishes in seconds.
"""

from __future__ import annotations

import pytest
import torch

from kserve_paged_kernels.reference import fused_moe_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("mt")  # every test runs with the kernels loadable


@pytest.fixture(scope="module")
def mt(triton_interpreter):
    return triton_interpreter.load("kserve_paged_kernels.triton_backend", "kserve_paged_kernels.moe_triton")


NUM_EXPERTS = 4


def _case(ids: list[list[int]], hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    topk_ids = torch.tensor(ids)
    num_tokens, top_k = topk_ids.shape
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    weights = weights / weights.sum(dim=-1, keepdim=True)
    x = torch.randn(num_tokens, hidden, generator=g)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(NUM_EXPERTS, hidden, inter, generator=g) / inter ** 0.5
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), w_gate_up.to(dtype=dtype, **to),
            w_down.to(dtype=dtype, **to), weights.to(**to), topk_ids.to(**to))


def _ids(num_tokens: int, top_k: int, experts: list[int], seed: int) -> list[list[int]]:
    """Each token's distinct top_k choices drawn from `experts` (uneven, seeded)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    return [pool[torch.randperm(len(experts), generator=g)[:top_k]].tolist()
            for _ in range(num_tokens)]


CASES = [
    # (name, topk ids, hidden, inter)
    ("decode-top2", _ids(3, 2, [0, 1, 2, 3], 1), 64, 48),
    # 21 tokens (not a multiple of the row block), expert 2 gets no token, expert 0 most.
    ("prefill-top2-empty-expert", [[0, 1]] * 9 + [[0, 3]] * 6 + [[3, 1]] * 5 + [[1, 0]], 48, 80),
    ("top1-uneven", [[0]] * 13 + [[3]] * 2 + [[1]], 40, 72),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "ids", "hidden", "inter"), CASES, ids=[c[0] for c in CASES])
def test_fused_moe_matches_the_reference(mt, name, ids, hidden, inter, dtype):
    x, w_gate_up, w_down, weights, topk_ids = _case(ids, hidden, inter, dtype)
    got = mt.fused_moe(x, w_gate_up, w_down, weights, topk_ids)
    want = fused_moe_ref(x, w_gate_up, w_down, weights, topk_ids)
    assert got.dtype == dtype and got.shape == x.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=atol)


def test_align_pairs_pads_each_expert_to_whole_blocks(mt):
    """Every pair appears once, in a block of its own expert; padding is the sentinel; an
    expert without pairs owns no block; blocks past the used ones are marked -1."""
    ids = torch.tensor([[0, 1]] * 5 + [[3, 1]] * 2)  # expert 0: 5, 1: 7, 2: 0, 3: 2 pairs
    sorted_pairs, block_expert = mt.align_pairs(ids, NUM_EXPERTS, block_m=4)
    num_pairs = ids.numel()
    assert block_expert.tolist() == [0, 0, 1, 1, 3] + [-1] * (block_expert.numel() - 5)
    blocks = sorted_pairs.view(-1, 4)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        for pair in blocks[b].tolist():
            if pair == num_pairs:
                continue
            assert expert >= 0 and ids.flatten()[pair] == expert
            seen.append(pair)
    assert sorted(seen) == list(range(num_pairs))
    assert bool((sorted_pairs[20:] == num_pairs).all())  # unused blocks hold padding only


def test_sparse_moe_uses_the_kernel_and_matches_the_grouped_torch_path(mt, monkeypatch):
    """engine/kserve_paged_engine/model_executor/models/moe.py's SparseMoE on its CUDA path (forced here, in the interpreter)
    against its own torch grouped path on the same weights, renormalised top-2."""
    from kserve_paged_engine.model_executor.models import moe

    torch.manual_seed(0)
    layer = moe.SparseMoE(hidden=32, inter=48, num_experts=NUM_EXPERTS, top_k=2,
                          renormalize=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(11, 32)
    want = layer(x)
    assert moe._fused_moe_kernel(x.device) is None  # CPU keeps the grouped torch path
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return mt.fused_moe(*args)

    monkeypatch.setattr(moe, "_fused_moe_kernel", lambda device: counted)
    got = layer(x)
    assert calls == [x.shape]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_align_pairs_reads_no_device_value_back(mt):
    """The routing makes no host read, in Python or inside torch's C++ (torch.bincount reads
    its range back on CUDA: a sync per layer, and an error inside a CUDA-graph capture)."""
    from tests.helpers.host_reads import host_reads

    ids = torch.tensor([[0, 1]] * 5 + [[3, 1]] * 2)
    with host_reads() as reads:
        mt.align_pairs(ids, NUM_EXPERTS, block_m=4)
    assert reads.sites == {}


def test_align_pairs_runs_on_a_cuda_device_from_shapes_alone(mt):
    """Under FakeTensorMode the tensors are on `cuda` without a GPU and hold no values: any op
    whose output depends on the data (bincount, nonzero, .item()) raises, so this passing is
    the routing's static shapes, which a graph capture needs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        ids = torch.randint(0, NUM_EXPERTS, (7, 2), device="cuda")
        sorted_pairs, block_expert = mt.align_pairs(ids, NUM_EXPERTS, block_m=4)
    max_blocks = -(-(14 + NUM_EXPERTS * 3) // 4)
    assert sorted_pairs.device.type == block_expert.device.type == "cuda"
    assert sorted_pairs.shape == (max_blocks * 4,) and block_expert.shape == (max_blocks,)
