"""GPU-path arithmetic stays on the device of the values it starts from (issue 48, item 2): a
CPU tensor mixed into an op on CUDA tensors raises there, so beam search's step and
speculative verification's draw are run on a stand-in device that refuses the mix the same
way, without a GPU (tests/helpers/fake_reads.py: FakeTensorMode, host reads answered by
stand-in values)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kserve_paged_engine.frontend.beam_search import BeamSearch, BeamSearches
from kserve_paged_engine.sampling_params import SamplingParams
from kserve_paged_engine.spec_decode.rejection import rejection_sample
from tests.helpers.fake_reads import ReadReached, fake_reads


def test_a_beam_step_scores_on_its_logprobs_device_and_reads_back_once() -> None:
    """The step's arithmetic (summed scores + each beam's best log-probs, the top candidates,
    their tokens and finished scores) runs on the logits' device and reaches its one host
    read, of all four rows at once, without mixing."""
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    search = BeamSearch("r", params, frozenset({2}), 8, ["r", "r\x1fbeam0"], [-0.5, -0.7])
    with fake_reads(stop=True) as reads:
        for beam in search.beams:
            logprobs = torch.randn(300, device=reads.device).log_softmax(-1)
            search.reports[beam] = torch.topk(logprobs, search.num_candidates)
        with pytest.raises(ReadReached):
            BeamSearches().advance(search, SimpleNamespace(requests={}))
    assert reads.seen == [(reads.device, (4, search.num_candidates))]


@pytest.mark.parametrize("draft_model", [False, True])
def test_rejection_sampling_mixes_no_devices(draft_model: bool) -> None:
    """Reads answered with zeros reject every draft, so the residual and then its fallback are
    searched: the inverse-CDF search and its point stay on the target's device."""
    with fake_reads() as reads:
        target = torch.rand(3, 8, device=reads.device).softmax(-1)
        q = torch.rand(2, 8, device=reads.device).softmax(-1) if draft_model else None
        out = rejection_sample(target, [1, 2], q, torch.Generator().manual_seed(0))
    assert len(out) == 1 and isinstance(out[0], int)
    device_reads = [shape for device, shape in reads.seen if device == reads.device]
    # p (and q) at the drafts, then one read per draw: the residual's, then its fallback's.
    assert device_reads == [(2,)] * (2 if draft_model else 1) + [(2,), (2,)]
