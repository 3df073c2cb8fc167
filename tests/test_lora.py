"""Multi-LoRA serving against transformers + PEFT, token for token.

A tiny random Llama (SmolLM2's tokenizer, so the engine can load it) gets three random PEFT
adapters of different ranks, targets and scalings. One `generate` call mixes them with the base
model; each prompt's greedy continuation must equal what PEFT produces for that adapter alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kserve_paged_engine import LLM, SamplingParams  # noqa: E402
from kserve_paged_engine.lora import LoRARequest  # noqa: E402
from kserve_paged_engine.lora.batch import group_rows  # noqa: E402
from tests.helpers.core import make_request, make_scheduler  # noqa: E402
from tests.helpers.lora import make_adapter, peft_greedy, tiny_base  # noqa: E402

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ADAPTERS = {  # name -> LoraConfig kwargs
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"]),
    "mlp-r16": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "down_proj"]),
}
PROMPTS = [
    list(range(100, 123)),
    [7, 8, 9, 10, 11] * 7,
    list(range(3000, 3011)),
    list(range(500, 540, 2)),
    [42] * 9 + list(range(60, 75)),
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    tiny_base(root / "base")
    out = {"base": root / "base"}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        make_adapter(root / "base", root / name, seed=10 + i, **kw)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reference(dirs) -> dict[str | None, list[list[int]]]:
    """transformers (+ PEFT) greedy continuations, one adapter and one prompt at a time."""
    return {name: peft_greedy(dirs["base"], dirs[name] if name else None, PROMPTS, NEW)
            for name in [None, *ADAPTERS]}


def _loras(dirs) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(dirs[name])) for i, name in enumerate(ADAPTERS)}


# Each prompt under every adapter and the base, interleaved so every step mixes them.
def _mixed(dirs):
    loras = _loras(dirs)
    names = [None, *ADAPTERS]
    pairs = [(p, names[(i + j) % 4]) for i, p in enumerate(PROMPTS) for j in range(4)]
    return pairs, [loras[n] if n else None for _, n in pairs]


def _check(outs, pairs, reference) -> None:
    for out, (prompt, name) in zip(outs, pairs):
        want = reference[name][PROMPTS.index(prompt)]
        assert out.outputs[0].token_ids == want, f"adapter {name} prompt {PROMPTS.index(prompt)}"


@pytest.mark.slow
def test_adapters_change_the_output(reference):
    # The comparison below is meaningful only if each adapter moves the greedy path.
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


@pytest.mark.parametrize("options", [
    dict(),  # everything in one step
    dict(max_num_batched_tokens=16),  # chunked prefill across adapters
    dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),  # preemption
], ids=["one-step", "chunked", "preemption"])
@pytest.mark.slow
def test_mixed_adapter_batch_equals_peft(dirs, reference, options):
    llm = LLM(model=str(dirs["base"]), enable_lora=True, max_loras=3, max_lora_rank=16,
              max_model_len=128, **({"num_kv_blocks": 256} | options))
    pairs, loras = _mixed(dirs)
    outs = llm.generate([p for p, _ in pairs], GREEDY, use_tqdm=False, lora_request=loras)
    _check(outs, pairs, reference)
    if "num_kv_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.slow
def test_prefix_cache_never_hits_across_adapters(dirs, reference):
    llm = LLM(model=str(dirs["base"]), enable_lora=True, max_loras=3, num_kv_blocks=256,
              block_size=4, max_model_len=128)
    loras = _loras(dirs)
    prompt = PROMPTS[0]

    def run(name):
        before = llm.stats()["prefix_cache_hits"]
        out = llm.generate([prompt], GREEDY, use_tqdm=False,
                           lora_request=loras[name] if name else None)[0]
        assert out.outputs[0].token_ids == reference[name][0]
        return llm.stats()["prefix_cache_hits"] - before

    assert run("attn-r4") == 0
    assert run("mlp-r16") == 0  # same tokens, another adapter: no hit
    assert run(None) == 0  # nor for the base model
    assert run("attn-r4") > 0  # the same adapter again hits its own prefix
    assert run(None) > 0


def test_max_loras_holds_back_other_adapters_and_stays_exact(dirs, reference):
    llm = LLM(model=str(dirs["base"]), enable_lora=True, max_loras=1, max_cpu_loras=2,
              num_kv_blocks=256, max_model_len=128)
    seen: list[set[int]] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append({r.lora_request.lora_int_id for r in out.scheduled if r.lora_request})
        return out

    llm.engine.scheduler.schedule = spy
    pairs, loras = _mixed(dirs)
    outs = llm.generate([p for p, _ in pairs], GREEDY, use_tqdm=False, lora_request=loras)
    _check(outs, pairs, reference)
    assert max(len(s) for s in seen) == 1
    assert llm.stats()["max_lora"] == 1 and llm.stats()["running_lora_adapters"] == ""
    assert len(set().union(*seen)) == 3
    assert len(llm.engine.list_loras()) <= 2  # the LRU of loaded adapters


def test_scheduler_counts_active_adapters_against_max_loras():
    sched = make_scheduler(max_num_seqs=8, max_loras=2)
    lora = [LoRARequest(f"a{i}", i, "/nowhere") for i in (1, 2, 3)]
    reqs = [make_request(f"r{i}", 8, max_tokens=3) for i in range(6)]
    for i, req in enumerate(reqs):
        req.lora_request = lora[i % 3] if i < 5 else None
        sched.add_request(req)
    out = sched.schedule()
    ids = {r.lora_request.lora_int_id for r in out.scheduled if r.lora_request}
    assert ids == {1, 2}
    # The held-back adapter's requests keep their place; the base request is not blocked.
    assert [r.request_id for r in out.scheduled] == ["r0", "r1", "r3", "r4", "r5"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_block_hashes_differ_per_adapter():
    from kserve_paged_engine.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(16, 4)
    reqs = [make_request(f"r{i}", [5] * 9) for i in range(3)]
    reqs[1].lora_request = LoRARequest("a", 1, "/x")
    reqs[2].lora_request = LoRARequest("b", 2, "/y")
    for r in reqs:
        kv.find_prefix(r)
    assert len({r.block_hashes[0] for r in reqs}) == 3
    assert len({r.block_hashes[1] for r in reqs}) == 3


def test_group_rows_sorts_by_adapter():
    rows, runs = group_rows(np.array([0, 2, 2, 1, 0, 2, 1]))
    assert rows.tolist() == [3, 6, 1, 2, 5]
    assert runs == [(1, 0, 2), (2, 2, 5)]
    rows, runs = group_rows(np.zeros(3, dtype=np.int64))
    assert rows.size == 0 and runs == []


def test_bad_adapters_are_clear_errors(dirs, tmp_path):
    llm = LLM(model=str(dirs["base"]), enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("big", 1, str(dirs["mlp-r16"])))
    with pytest.raises(ValueError, match="not a folder"):
        llm.engine.add_lora(LoRARequest("missing", 2, str(tmp_path / "nope")))
    bad = tmp_path / "dora"
    shutil.copytree(dirs["attn-r4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    with pytest.raises(ValueError, match="unsupported option"):
        llm.engine.add_lora(LoRARequest("dora", 3, str(bad)))
    llm.engine.add_lora(LoRARequest("ok", 4, str(dirs["attn-r4"])))
    with pytest.raises(ValueError, match="already used"):
        llm.engine.add_lora(LoRARequest("other", 4, str(dirs["all-r8-rslora"])))
    assert not llm.engine.has_unfinished_requests()
    plain = LLM(model=str(dirs["base"]), num_kv_blocks=64)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("x", 1, str(dirs["attn-r4"])))


def test_lora_stats_name_running_and_waiting_adapters(dirs):
    llm = LLM(model=str(dirs["base"]), enable_lora=True, max_loras=1, max_cpu_loras=2,
              num_kv_blocks=64, max_model_len=128)
    loras = _loras(dirs)
    llm.engine.add_request("x", PROMPTS[0], GREEDY, lora_request=loras["attn-r4"])
    llm.engine.add_request("y", PROMPTS[1], GREEDY, lora_request=loras["mlp-r16"])
    llm.engine.add_request("z", PROMPTS[2], GREEDY)
    llm.engine.step()
    stats = llm.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"],
            stats["max_lora"]) == ("attn-r4", "mlp-r16", 1)
    assert stats["num_running"] == 2  # the base request is not held back
    llm.engine.abort_request(["x", "y", "z"])
