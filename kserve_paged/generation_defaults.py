"""`--generation_config auto`: the sampling defaults a model's folder ships (vLLM's reading of
generation_config.json), as a SamplingRequest under every request's own values."""

from __future__ import annotations

import json
from pathlib import Path

from kserve_paged.request_options import SamplingRequest

# generation_config.json's sampling fields that become defaults (vLLM's list), by our names.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str | None) -> SamplingRequest:
    """`--generation_config auto`: the sampling defaults the model's folder ships in
    generation_config.json (none when it has none); a request's own values override them.
    Its max_new_tokens is a default budget, never taken for the client's max_tokens."""
    if not model_path:
        return SamplingRequest()
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return SamplingRequest()
    if not isinstance(config, dict):
        return SamplingRequest()
    found = {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
             if config.get(theirs) is not None}
    budget = found.pop("max_tokens", None)
    ok = isinstance(budget, int) and not isinstance(budget, bool) and budget > 0
    return SamplingRequest.of(found, default_max_tokens=budget if ok else None)
