"""Metrics parity with vLLM (issue 24): names, types, labels and buckets against a vendored list
of vLLM's metrics (tests/data/vllm_metrics.json), what the step observer records for finished and
aborted requests, and this project's KV waste gauges from a real scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kserve_paged import metric_families as mf
from kserve_paged import metrics as m
from kserve_paged_engine.core.request import RequestStatus
from kserve_paged_engine.frontend.async_llm import StepInfo
from kserve_paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.helpers.core import apply_step, fake_step, make_request, make_scheduler

VLLM = json.loads((Path(__file__).parent / "data" / "vllm_metrics.json").read_text())["metrics"]
# vLLM labels every series with its engine index as well (data-parallel ranks in one process);
# this server runs one engine per pod and leaves that label out (docs/operations.md).
NOT_OURS = {"engine"}


def scrape(registry: CollectorRegistry) -> dict[str, dict]:
    """Per exposed family name (counters with _total): type, label names, bucket bounds."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        name = family.name + "_total" if family.type == "counter" else family.name
        entry = out.setdefault(name, {"type": family.type, "labels": set(), "buckets": [],
                                      "values": {}})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                if sample.labels["le"] != "+Inf":
                    entry["buckets"].append(float(sample.labels["le"]))
                continue
            entry["labels"] |= set(sample.labels)
            for key, value in sample.labels.items():
                entry["values"].setdefault(key, set()).add(value)
    for entry in out.values():
        entry["buckets"] = sorted(set(entry["buckets"]))
    return out


def one_to_two_to_five(max_value: int) -> list[float]:
    """vLLM's build_1_2_5_buckets, written out from its description."""
    values, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * 10**exponent > max_value:
                return values
            values.append(float(mantissa * 10**exponent))
        exponent += 1


@pytest.fixture
def exposed() -> dict[str, dict]:
    registry = CollectorRegistry()
    m.EngineMetrics("paged-llm", registry=registry).set_cache_config(16, 100)
    return scrape(registry)


@pytest.mark.parametrize("metric", VLLM, ids=[v["name"] for v in VLLM])
def test_each_vllm_metric_has_its_name_type_labels_and_buckets(metric, exposed):
    ours = exposed.get(metric["name"])
    assert ours is not None, f"{metric['name']} is not exposed"
    assert ours["type"] == metric["type"]
    if isinstance(metric["labels"], list):
        assert ours["labels"] == set(metric["labels"]) - NOT_OURS
    else:  # cache_config_info: labelled with the config's fields
        assert {"model_name", "block_size", "num_gpu_blocks"} <= ours["labels"]
    for label, values in metric.get("label_values", {}).items():
        assert set(values) <= ours["values"][label]
    buckets = metric.get("buckets")
    if isinstance(buckets, list):
        assert ours["buckets"] == [float(b) for b in buckets]
    elif buckets is not None:  # 1-2-5 up to max_model_len: ours is the series to 5e7
        for max_model_len in (512, 2048, 8192, 131072, 1_000_000):
            cut = [b for b in ours["buckets"] if b <= max_model_len]
            assert cut == one_to_two_to_five(max_model_len), max_model_len


def test_the_vendored_list_is_what_metric_names_says(exposed):
    """Every vLLM name in our contract is in the vendored list, so the test above covers all."""
    ours = ({n for n in mf.metric_names() if n.startswith("vllm:")} - mf.OWN_VLLM_STYLE
            - mf.VLLM_OFFLOAD_TIERING - mf.VLLM_STYLE_SWAP)
    assert ours == {v["name"] for v in VLLM}
    assert set(mf.FINISH_REASONS) == {s.value for s in RequestStatus if s.finished}


def test_lora_info_reports_no_adapters_with_a_fresh_timestamp():
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("a", registry=registry)
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                 if f.name == "vllm:lora_requests_info"]
    (sample,) = family.samples
    assert sample.labels == {"max_lora": "0", "waiting_lora_adapters": "",
                             "running_lora_adapters": ""}
    first = sample.value
    assert first > 1.6e9  # a Unix time, as vLLM's set_to_current_time
    metrics.touch_lora_info()
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                 if f.name == "vllm:lora_requests_info"]
    assert family.samples[0].value >= first
    # With adapters, the labels follow the engine's stats, one series at a time.
    metrics.touch_lora_info({"max_lora": 2, "running_lora_adapters": "a1,a2",
                             "waiting_lora_adapters": "a3"})
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                 if f.name == "vllm:lora_requests_info"]
    assert [s.labels for s in family.samples] == [{
        "max_lora": "2", "waiting_lora_adapters": "a3", "running_lora_adapters": "a1,a2"}]


def _value(registry, name, **labels) -> float:
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not found")


def test_observer_records_finished_and_aborted_requests():
    registry = CollectorRegistry()
    observer = m.MetricsObserver(m.EngineMetrics("a", registry=registry))
    t = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.5,
                       last_token_time=104.5, finished_time=104.5)
    done = RequestOutput("r1", None, list(range(30)),
                         [CompletionOutput(0, "x", list(range(7)), finish_reason="length",
                                           delta_token_ids=[6])], True, metrics=t)
    failed = RequestOutput("r2", None, [1, 2], [CompletionOutput(0, "", [], "error")], True,
                           metrics=RequestMetrics(arrival_time=100.0), error="boom")
    observer(StepInfo({}, [done, failed], ["r3", "r4"], 8, True, 105.0))
    assert _value(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(registry, "vllm:request_success_total", finished_reason="error") == 1
    assert _value(registry, "vllm:request_success_total", finished_reason="abort") == 2
    assert _value(registry, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(registry, "vllm:request_prompt_tokens_sum") == 32
    assert _value(registry, "vllm:request_generation_tokens_sum") == 7
    assert _value(registry, "vllm:request_generation_tokens_count") == 2
    assert _value(registry, "vllm:request_prefill_time_seconds_sum") == pytest.approx(1.0)
    assert _value(registry, "vllm:request_decode_time_seconds_sum") == pytest.approx(3.0)
    assert _value(registry, "vllm:request_inference_time_seconds_sum") == pytest.approx(4.0)
    assert _value(registry, "vllm:request_decode_time_seconds_count") == 1  # r2 never ran


def test_kv_waste_gauges_follow_the_scheduler():
    """Two requests sharing a 3-block prefix, block size 4: the gauges read the scheduler's
    figures (reserved slots, slots holding a token, shared blocks)."""
    sched = make_scheduler(num_blocks=32, block_size=4)
    shared = list(range(100, 112))
    for rid, tail in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7])):
        sched.add_request(make_request(rid, shared + tail, max_tokens=5))
        out = sched.schedule()
        apply_step(sched, out, fake_step(sched, out))
    stats = sched.stats()
    # a: 17 prompt + 2 sampled (it decoded in b's step) = 19 tokens in 5 blocks;
    # b: 14 + 1 = 15 tokens in 4 blocks, the first 3 shared with a.
    assert sched.requests["a"].num_tokens == 19 and sched.requests["b"].num_tokens == 15
    assert stats["kv_blocks_shared"] == 3
    assert stats["kv_slots_allocated"] == (5 + 4 - 3) * 4
    assert stats["kv_slots_used"] == stats["kv_slots_allocated"] - (20 - 19) - (16 - 15)
    registry = CollectorRegistry()
    m.EngineMetrics("a", registry=registry).update(stats)
    assert _value(registry, "kserve_paged:kv_blocks_shared", model_name="a") == 3
    assert _value(registry, "kserve_paged:kv_slots_reserved", model_name="a") == 24
    assert _value(registry, "kserve_paged:kv_slots_holding_tokens", model_name="a") == 22
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.stats()["kv_blocks_shared"] == 0


def test_the_kv_tier_series_appear_with_a_tier_under_vllm_offloading_names():
    registry = CollectorRegistry()
    metrics = m.EngineMetrics("a", registry=registry)
    assert not [s for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples if s.name.startswith("vllm:kv_offload")]
    stats = {"kv_tier_block_queries": 12, "kv_tier_block_hits": 10, "kv_tier_read_bytes": 4096,
             "kv_tier_write_bytes": 8192, "kv_tier_read_time": 0.5, "kv_tier_write_time": 0.25,
             "kv_tier_corrupt_blocks": 1, "kv_tier_usage": 0.125, "kv_swap_outs": 3,
             "kv_swap_ins": 2, "num_requests_swapped": 1}
    metrics.update(stats)
    metrics.update(stats | {"kv_tier_block_hits": 11})
    assert _value(registry, "vllm:kv_offload_tiering_block_hits_total", tier="1:fs") == 11
    assert _value(registry, "vllm:kv_offload_tiering_write_bytes_total", model_name="a") == 8192
    assert _value(registry, "kserve_paged:kv_offload_tier_usage_perc", tier="1:fs") == 0.125
    assert _value(registry, "kserve_paged:kv_offload_tier_corrupt_blocks_total") == 1
    assert _value(registry, "vllm:num_swap_outs_total", model_name="a") == 3
    assert _value(registry, "vllm:num_swap_ins_total") == 2
    assert _value(registry, "vllm:num_requests_swapped") == 1
    assert {n for n in mf.metric_names() if n.startswith("vllm:kv_offload")} == (
        mf.VLLM_OFFLOAD_TIERING)
    host = {"kv_host_tier_block_hits": 7, "kv_host_tier_usage": 0.5}  # on a GPU
    metrics.update(stats | {"kv_tier_block_hits": 11} | host)  # a host tier above the disk
    assert _value(registry, "vllm:kv_offload_tiering_block_hits_total", tier="0:CPU") == 7
    assert _value(registry, "vllm:kv_offload_tiering_block_hits_total", tier="1:fs") == 11
    assert _value(registry, "kserve_paged:kv_offload_tier_usage_perc", tier="0:CPU") == 0.5
