"""Wire options to one prompt's SamplingParams, as a front end and the served model make them
(kserve_paged/request_options.py), for tests that check options without a server."""

from __future__ import annotations

from typing import Any

from kserve_paged.request_options import SamplingRequest
from kserve_paged_engine.sampling_params import SamplingParams


def make_sampling_params(options: dict[str, Any], *, prompt_len: int, max_model_len: int,
                         default_max_tokens: int | None, vocab_size: int | None = None
                         ) -> SamplingParams:
    """One prompt's SamplingParams from wire options."""
    request = SamplingRequest.of(options, vocab_size=vocab_size,
                                 default_max_tokens=default_max_tokens)
    return request.params(prompt_len, max_model_len)
