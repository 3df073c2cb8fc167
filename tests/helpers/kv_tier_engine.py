"""A tiny engine over a small pool with a second KV tier, the prompts that fill and flood it,
and a greedy run: what the KV tier's engine tests (tests/test_kv_tier.py, test_kv_swap.py,
test_kv_tier_host.py) share, so each checks the tier on the same engine and prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
from kserve_paged_engine.lora import LoRARequest
from tests.helpers.lora import tiny_base

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37) % 5000 + 10 for i in range(41)]  # 10 full blocks before its last token
FLOODS = [[(i * 53 + k * 1000) % 7000 + 20 for i in range(41)] for k in (1, 2, 3)]


def tier_json(root: Path, **extra) -> str:
    """KServe 0.20's rendering of spec.kvCacheOffloading."""
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {
                           "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                           "eviction_policy": "lru",
                           "secondary_tiers": [{"type": "fs", "root_dir": str(root)}], **extra}})


def tier_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random base model (tests/helpers/lora.py) in a fresh folder: `base`, and `root`
    beside it for adapters; each test module builds it once (its module-scoped `dirs`)."""
    root = tmp_path_factory.mktemp("kv_tier")
    tiny_base(root / "base")
    return {"base": root / "base", "root": root}


def engine(dirs, dtype: str, tmp: Path | None, **kw) -> LLM:
    """A pool of 24 blocks of 4 tokens: two other prompts evict the first one's blocks."""
    opts = dict(model=str(dirs["base"]), block_size=BS, num_kv_blocks=24, max_model_len=96,
                dtype=dtype, max_num_seqs=2) | kw
    if tmp is not None:
        opts["kv_transfer_config"] = tier_json(tmp)
    return LLM(**opts)


def run(llm: LLM, prompt: list[int], salt: str | None = None,
        lora: LoRARequest | None = None) -> list[int]:
    eng = llm.engine
    rid = eng.next_request_id()
    eng.add_request(rid, prompt, GREEDY, cache_salt=salt, lora_request=lora)
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def hits(llm: LLM) -> int:
    return llm.engine.kv_tier.stats.hits


def flood(llm: LLM) -> None:
    for p in FLOODS:
        run(llm, p)


class Fixed(MeasuredRate):
    """A stubbed rate: measurements do not move it."""

    __slots__ = ()

    def observe(self, amount: float, seconds: float) -> None:
        pass
